"""What GRPO adds to a step: memory and generation time (pure arithmetic).

Modelled as the worker generates and trains (`homelab_dp.train.objectives.grpo_generation`,
`homelab_dp.train.objectives.grpo_losses`), per rank:

* **The KV cache of generation.** A prompt's ``generations`` completions are decoded together:
  keys and values of every layer for ``generations × (prompt + max_completion_tokens)`` tokens
  (sliding-window layers keep at most their window), in the compute width
  (`kv_cache_bytes`). One group is decoded at a time; the cache is freed before the
  optimizer's forward, so it peaks beside the model states, not beside the activations.
* **The completions' logits.** The policy's forward over ``prompts × generations`` rows of
  ``prompt + max_completion_tokens`` tokens keeps the logits of the completion tokens
  (``V`` each, compute width) and their fp32 log-softmax rows; the backward holds the fp32
  rows, two fp32 gradients and the logits' gradient (`completion_logits_bytes`), as the
  preference objectives' plain logits path.
* **The reference forward** when ``beta > 0``: one no-grad forward of the same rows (the base
  with the adapters off), whose peak is its own logits head; nothing of it is saved but
  its per-token log-probabilities (fp32).
* **The old policy's log-probabilities** when ``iterations > 1``: fp32 per completion token,
  kept for the generated batch's passes, from one no-grad forward at generation time.

Time (`generation_seconds`): decoding is bound by memory bandwidth, not FLOPs: each new token
of a group reads every weight once and the group's KV cache so far; a step decodes
``prompts per rank`` groups of ``max_completion_tokens`` tokens (an upper bound: a group
ends early when every completion hit its eos). `GrpoCost.generation_share` is the share of a
step spent generating.
"""

from __future__ import annotations

from dataclasses import dataclass

from homelab_dp.planning.model_spec import ModelSpec


def kv_cache_bytes(spec: ModelSpec, generations: int, tokens: int, width: float) -> int:
    """Keys and values of every layer for ``generations`` rows of ``tokens`` tokens (a
    sliding-window layer holds at most its window)."""
    per_token_layer = 2 * spec.kv_heads * spec.head_dim * width
    sliding = min(spec.sliding_layers, spec.layers) if spec.sliding_window else 0
    window = min(tokens, spec.sliding_window) if spec.sliding_window else tokens
    full = spec.layers - sliding
    return int(per_token_layer * generations * (full * tokens + sliding * window))


def completion_logits_bytes(
    spec: ModelSpec, rows: int, row_tokens: int, completion_tokens: int, width: float
) -> dict[str, int]:
    """The policy's logits over ``rows`` rows of ``row_tokens`` tokens, of which
    ``completion_tokens`` each are normalised: bytes at the forward's peak and at the
    backward's start."""
    logits = rows * row_tokens * spec.vocab * width
    rows32 = rows * completion_tokens * spec.vocab * 4
    forward = logits + rows32 + (rows * completion_tokens * spec.vocab * width if width != 4 else 0)
    return {"forward": int(forward), "backward": int(3 * rows32 + logits)}


@dataclass(frozen=True)
class GrpoCost:
    """GRPO's additions to one rank's step (bytes and seconds)."""

    kv_cache: int
    completion_logits: int
    """The larger of the logits' forward and backward peaks."""
    reference: int
    """The reference's no-grad forward peak and its kept log-probabilities (beta > 0), else 0."""
    old_logps: int
    """The old policy's log-probabilities (iterations > 1), else 0."""
    generation_s: float
    train_s: float
    engine: str = "transformers"
    """What generates (`homelab_dp.train.objectives.grpo_generation.engine_name`)."""

    @property
    def peak_extra(self) -> int:
        """The most GRPO adds at once: generation's cache, or the training forward's logits
        with the reference's and old log-probabilities beside them."""
        return max(self.kv_cache, self.completion_logits + self.reference + self.old_logps)

    @property
    def generation_share(self) -> float:
        """The share of a step spent generating (0..1)."""
        total = self.generation_s + self.train_s
        return self.generation_s / total if total > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        """For ``plan --json``."""
        return {"kv_cache_bytes": self.kv_cache, "completion_logits_bytes": self.completion_logits,
                "reference_bytes": self.reference, "old_logps_bytes": self.old_logps,
                "peak_extra_bytes": self.peak_extra, "generation_s": self.generation_s,
                "generation_share": self.generation_share, "engine": self.engine}  # fmt: skip


def generation_seconds(
    spec: ModelSpec, *, weight_bytes: float, groups: int, generations: int, prompt_tokens: int,
    completion_tokens: int, width: float, bandwidth: float,
) -> float:  # fmt: skip
    """Seconds to decode ``groups`` groups of ``completion_tokens`` tokens at ``bandwidth``
    bytes/s: each token reads the weights and the group's cache so far (its mean size)."""
    mean_cache = kv_cache_bytes(spec, generations, prompt_tokens + completion_tokens // 2, width)
    return groups * completion_tokens * (weight_bytes + mean_cache) / bandwidth


def grpo_cost(
    spec: ModelSpec, *, generations: int, prompt_tokens: int, max_completion_tokens: int,
    prompts_per_micro: int, prompts_per_rank: int, width: float, beta: float, iterations: int,
    weight_bytes: float, bandwidth: float, train_s: float, layer_bytes_per_token: float = 0.0,
    engine: str = "transformers",
) -> GrpoCost:  # fmt: skip
    """GRPO's memory and time on one rank (see the module docstring). ``prompts_per_rank``:
    the prompts a rank generates for in a step (micro × accumulation); ``weight_bytes``: the
    weights a decode step reads (QLoRA: the 4-bit base); ``train_s``: the step's time without
    generation; ``layer_bytes_per_token``: one decoder layer's transient tensors."""
    tokens = prompt_tokens + max_completion_tokens
    rows = prompts_per_micro * generations
    logits = completion_logits_bytes(spec, rows, tokens, max_completion_tokens, width)
    reference = 0
    if beta > 0:
        ref_peak = max(logits["forward"], int(layer_bytes_per_token * rows * tokens))
        reference = ref_peak + rows * max_completion_tokens * 4
    old = rows * max_completion_tokens * 4 * prompts_per_rank // max(prompts_per_micro, 1)
    gen = generation_seconds(spec, weight_bytes=weight_bytes, groups=prompts_per_rank,
                             generations=generations, prompt_tokens=prompt_tokens,
                             completion_tokens=max_completion_tokens, width=width,
                             bandwidth=bandwidth)  # fmt: skip
    return GrpoCost(kv_cache=kv_cache_bytes(spec, generations, tokens, width),
                    completion_logits=max(logits.values()), reference=reference,
                    old_logps=old if iterations > 1 else 0, generation_s=gen, train_s=train_s,
                    engine=engine)  # fmt: skip


def grpo_knobs(spec: ModelSpec, cost: GrpoCost, short: int, *, generations: int,
               max_completion_tokens: int, method: str) -> list[str]:  # fmt: skip
    """What helps a GRPO plan that is ``short`` bytes short, most effective first: fewer
    generations (halved), shorter completions (halved), QLoRA (for a 16-bit base)."""
    if short <= 0:
        return []
    out = []
    if generations >= 4:
        out.append(f"grpo.generations = {generations // 2} (halves the KV cache and the "
                   f"completions' logits: about {cost.peak_extra // 2 / 2**30:.1f} GiB less)")  # fmt: skip
    if max_completion_tokens >= 64:
        out.append(f"grpo.max_completion_tokens = {max_completion_tokens // 2} (a shorter cache "
                   "and fewer logits)")  # fmt: skip
    if method != "qlora":
        saved = spec.params * 2 - spec.params // 2
        out.append(f"train.method = 'qlora' (a 4-bit base: about {saved / 2**30:.1f} GiB less)")
    return out
