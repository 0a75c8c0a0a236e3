"""What samples while training add to a run's time (``train.sample_every``; pure, stdlib).

The worker answers every sample prompt at each sampling round (`homelab_dp.train.loop.sample_answers`): the
prompt once through the model, then one forward per new token with a KV cache. Its cost:

    seconds = rounds × prompts × (prompt tokens + max new tokens) × forward FLOPs per token
              ÷ (the run's training FLOP/s = training tokens/s × training FLOPs per token)

The forward FLOPs per token are a third of a full fine-tune's training FLOPs per token
(`planning.flops.flops_per_token`: forward + 2× forward backward, no recomputation), with the
attention span of the sample's own length. Adapters' forward is left out (well under 1%).

A floor: decoding one token at a time is bound by reading the weights from memory, not by the
matmuls, so a card decodes slower than its training FLOP/s say (a few times on large models);
what a run measures is in its ``sample`` events (``seconds``), and the run's ETA counts those
(`homelab_dp.runs.run_view.RunView.eta_s`).
"""

from __future__ import annotations

import math
from typing import Any

from homelab_dp.data.sample_prompts import prompt_count
from homelab_dp.planning.flops import causal_span, flops_per_token
from homelab_dp.planning.model_spec import ModelSpec

PROMPT_TOKENS = 64
"""The prompt length a plan assumes (at most data.seq_len): the prompts are not tokenized yet."""


def sampling_rounds(
    sample_every: str | int, total_steps: int, *, eval_every: int = 0, has_eval: bool = False
) -> int:
    """How many times a run of ``total_steps`` optimizer steps samples: "eval" with each
    evaluation (every ``eval_every`` steps and at the last; none without eval data), N every N
    steps and at the last, "off" (or N of 0 or less) never."""
    if total_steps <= 0:
        return 0
    if sample_every == "eval":
        if not has_eval:
            return 0
        every = eval_every if eval_every > 0 else total_steps
    elif isinstance(sample_every, bool) or not isinstance(sample_every, int):
        return 0
    else:
        every = sample_every
    if every <= 0:
        return 0
    return math.ceil(total_steps / every)  # every multiple of N, plus the last when it is none


def forward_flops_per_token(spec: ModelSpec, context: int) -> float:
    """Matmul FLOPs of one token's forward pass at ``context`` tokens of (causal) context."""
    full = flops_per_token(
        spec, method="full", activation_checkpointing=False, attention_span=causal_span(context)
    )
    return full / 3.0  # full fine-tune: forward + backward (2× forward), nothing recomputed


def sample_seconds(
    spec: ModelSpec,
    *,
    rounds: int,
    prompts: int,
    prompt_tokens: int,
    max_tokens: int,
    train_tokens_per_s: float,
    train_flops_per_token: float,
) -> float:
    """Seconds a run spends on samples (see the module docstring); 0 when it samples nothing
    or nothing is known of its throughput."""
    rate = train_tokens_per_s * train_flops_per_token  # the run's FLOP/s
    if rounds <= 0 or prompts <= 0 or max_tokens <= 0 or rate <= 0:
        return 0.0
    tokens = prompt_tokens + max_tokens
    return rounds * prompts * tokens * forward_flops_per_token(spec, tokens) / rate


def planned_sample_seconds(
    spec: ModelSpec,
    preset: Any,
    total_steps: int,
    *,
    train_tokens_per_s: float,
    train_flops_per_token: float,
) -> float:
    """`sample_seconds` of a preset's run of ``total_steps`` steps (``preset``: a
    `presets.preset.Preset`), at the training throughput the plan expects."""
    data, train = preset.data, preset.train
    rounds = sampling_rounds(train.sample_every, total_steps, eval_every=int(train.eval_every),
                             has_eval=bool(data.eval_path or data.eval_fraction > 0))  # fmt: skip
    return sample_seconds(
        spec, rounds=rounds, prompts=prompt_count(data.sample_prompts),
        prompt_tokens=min(PROMPT_TOKENS, int(data.seq_len)),
        max_tokens=int(train.sample_max_tokens), train_tokens_per_s=train_tokens_per_s,
        train_flops_per_token=train_flops_per_token,
    )  # fmt: skip


def sample_plan(
    spec: ModelSpec,
    preset: Any,
    *,
    method: str,
    activation_checkpointing: bool,
    steps: int,
    train_tokens_per_s: float | None,
) -> dict[str, Any] | None:
    """The ``samples`` block of `plan --json` (None when the run samples nothing): ``rounds``,
    ``prompts``, ``max_tokens`` and ``seconds``, the time they add at ``train_tokens_per_s``
    (what the preset's recorded runs measured; ``seconds`` is None without them, or without
    ``steps``: a run that counts epochs has its steps only once its data is read)."""
    data, train = preset.data, preset.train
    has_eval = bool(data.eval_path or data.eval_fraction > 0)
    every = train.sample_every
    if every == "off" or (every == "eval" and not has_eval):
        return None
    rounds = sampling_rounds(every, steps, eval_every=int(train.eval_every), has_eval=has_eval)
    if steps > 0 and rounds == 0:
        return None
    seconds = None
    if train_tokens_per_s and steps > 0:
        per_token = flops_per_token(
            spec, method=method, activation_checkpointing=activation_checkpointing,
            attention_span=causal_span(int(data.seq_len)), lora_r=int(preset.lora.r),
            lora_targets=preset.lora.target_modules,
        )  # fmt: skip
        seconds = planned_sample_seconds(spec, preset, steps, train_tokens_per_s=train_tokens_per_s,
                                         train_flops_per_token=per_token)  # fmt: skip
    return {
        "rounds": rounds if steps > 0 else None,
        "prompts": prompt_count(data.sample_prompts),
        "max_tokens": int(train.sample_max_tokens),
        "seconds": seconds,
    }
