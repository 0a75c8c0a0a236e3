"""The ``[grpo]`` section of a preset: online reinforcement learning with a verifiable reward.

Read only when ``train.objective = "grpo"``. The names are a contract (other programs read
them): keep them. `grpo_checks` checks the fields against each other and the reward list
(`homelab_dp.presets.reward_specs`: built-ins and user ``file.py:function`` rewards, the file
looked up beside the preset and its function found without running it), each problem one line
naming its key. Pure: stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from homelab_dp.presets.reward_specs import reward_problems

GrpoLoss = Literal["grpo", "dr_grpo", "dapo"]
ScaleRewards = Literal["group", "batch", "none"]
Engine = Literal["auto", "transformers"]


@dataclass
class GrpoSection:
    """GRPO (train.objective = "grpo"): generations, sampling, rewards and the loss."""

    generations: int = 8
    """Completions generated per prompt (the group whose rewards are compared); at least 2.
    train.micro_batch and the effective batch count prompts: a micro-step trains
    micro_batch × generations completions."""
    max_completion_tokens: int = 256
    """The most new tokens of one completion; one that reaches it is cut there."""
    temperature: float = 1.0
    """Sampling temperature of the completions, greater than 0 (the group needs different
    completions)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p
    (above 0, at most 1; 1 keeps every token)."""
    top_k: int = 0
    """Sample among the top_k most likely tokens only (0: no limit)."""
    beta: float = 0.0
    """The weight of the KL divergence to the reference (the base with the adapters off, as for
    DPO); 0 leaves the reference out (no reference forward)."""
    epsilon: float = 0.2
    """Clipping of the importance ratio: the ratio is kept within [1 − epsilon, 1 + epsilon_high]."""
    epsilon_high: float = 0.0
    """The upper clipping bound for asymmetric clipping (DAPO uses 0.28); 0: the same as
    epsilon."""
    loss: GrpoLoss = "dapo"
    """How token losses are normalised: grpo (each completion's mean over its tokens, then the
    mean over completions) | dr_grpo (the sum over every token / (completions ×
    max_completion_tokens)) | dapo (the sum over every token / the tokens of the whole
    generated batch)."""
    scale_rewards: ScaleRewards = "group"
    """Advantage = reward − its group's mean, divided by: group (the group's standard
    deviation) | batch (the whole batch's standard deviation) | none (not divided)."""
    iterations: int = 1
    """Optimizer steps on each generated batch (TRL's num_iterations): above 1, the batch's
    generating policy's log-probabilities are computed once, and the later steps' importance
    ratio to it is clipped by epsilon / epsilon_high; an epoch then takes iterations × the
    steps."""
    rewards: list[str] = field(default_factory=list)
    """Reward functions, summed with reward_weights: exact_answer (1 when the completion's last
    number, or its \\boxed{} answer, equals the data's "answer" column, else 0) |
    regex:PATTERN (1 when PATTERN is found in the completion, else 0) | length:MIN,MAX (1 for a
    completion of MIN to MAX characters, falling off linearly outside) | FILE.py:FUNCTION (your
    function(prompts, completions, **columns) -> list[float], from FILE beside the preset)."""
    reward_weights: list[float] = field(default_factory=list)
    """One weight per reward ([] : 1 each); the reward is the weighted sum."""
    reward_timeout_s: int = 60
    """Seconds one call of a user reward function may take (it runs in a process of its own);
    a call that takes longer ends the run with an error naming it."""
    rollouts: bool = True
    """Write every step's completions and their rewards to the run folder's
    rollouts/step-NNNNNN.jsonl (rank 0); false writes none."""
    engine: Engine = "auto"
    """What generates the completions: auto (transformers' generate with the weights being
    trained, adapters on) | transformers. The plan names the engine."""


POSITIVE = {"grpo.generations", "grpo.max_completion_tokens", "grpo.iterations",
            "grpo.reward_timeout_s"}  # fmt: skip
"""Fields that must be at least 1 (checked by `homelab_dp.presets.preset`)."""
NON_NEGATIVE = {"grpo.top_k", "grpo.beta", "grpo.epsilon_high"}
"""Fields that must not be negative."""


def grpo_checks(preset: Any) -> list[str]:
    """Every problem of the ``[grpo]`` section of a GRPO `homelab_dp.presets.preset.Preset`,
    one line each naming its key ([] for another objective: the section is then not read)."""
    g = preset.grpo
    if preset.train.objective != "grpo":
        return []
    out = []
    if g.generations < 2:
        out.append(f"grpo.generations: must be at least 2 (a group's rewards are compared with "
                   f"each other), got {g.generations}")  # fmt: skip
    if g.temperature <= 0:
        out.append(f"grpo.temperature: must be greater than 0 (the completions of a group "
                   f"must differ; 1.0 is usual), got {g.temperature}")  # fmt: skip
    if not 0 < g.top_p <= 1:
        out.append(f"grpo.top_p: must be above 0 and at most 1, got {g.top_p}")
    if not 0 < g.epsilon < 1:
        out.append(f"grpo.epsilon: must be above 0 and below 1 (0.2 is usual), got {g.epsilon}")
    t = preset.train
    if t.distribution not in ("auto", "ddp"):
        out.append(f"train.distribution: GRPO runs under ddp (each rank decodes its own prompts "
                   f"with unsharded weights; see docs/grpo.md), got {t.distribution!r}: set "
                   f"train.distribution = 'ddp', with train.method = 'qlora' or 'lora' to keep "
                   f"each card's copy small")  # fmt: skip
    d = preset.data
    if d.eval_path or d.eval_fraction > 0:
        out.append("data.eval_path / data.eval_fraction: GRPO has no held-out evaluation yet "
                   "(every step's rollouts and rewards are its record): leave them unset")  # fmt: skip
    if not isinstance(t.sample_every, str) and not d.sample_prompts:
        out.append(f"train.sample_every: GRPO samples its own prompts every step (the "
                   f"rollouts); set data.sample_prompts too, or train.sample_every = 'off', "
                   f"got {t.sample_every}")  # fmt: skip
    if g.beta > 0 and t.method == "full":
        out.append(f"grpo.beta: the KL's reference is the base with the adapters off, but "
                   f"train.method = 'full' has no adapters (got beta {g.beta}): set "
                   "train.method = 'lora' or 'qlora', or grpo.beta = 0")  # fmt: skip
    if not g.rewards:
        out.append('grpo.rewards: required for train.objective = "grpo" (e.g. ["exact_answer"] '
                   'or ["my_rewards.py:brevity"])')  # fmt: skip
    if g.reward_weights and len(g.reward_weights) != len(g.rewards):
        out.append(f"grpo.reward_weights: {len(g.reward_weights)} weight(s) for "
                   f"{len(g.rewards)} reward(s); give one per reward, or [] for 1 each")  # fmt: skip
    out += reward_problems(g.rewards, preset.source)
    if preset.data.format != "auto":
        out.append(f"data.format: GRPO reads prompts ({{\"prompt\"}} or chat {{\"messages\"}}, "
                   f"other columns passed to the rewards), got {preset.data.format!r}: set "
                   "data.format = 'auto'")  # fmt: skip
    return out
