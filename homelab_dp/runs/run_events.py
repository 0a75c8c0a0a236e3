"""The events of a run: their names and one typed shape each (pure: stdlib only).

A run's ``events.jsonl`` holds one JSON object a line, each with ``"type"`` and ``"time"`` (unix
seconds). Rank 0 of the worker writes start, micro, step, eval, sample, straggler, warning,
checkpoint, memory and end; any rank may write error; the keeper and the controller write state,
retry and error; the device monitor writes devices samples to ``devices.jsonl``. Writers build the typed
event and write ``to_json()``; readers turn a line back into one with `parse_event`, which
accepts lines written before a field existed (missing fields take their defaults, unknown ones
are ignored).

Scripts read these names and fields: add, never rename.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

START = "start"
MICRO = "micro"
STEP = "step"
EVAL = "eval"
SAMPLE = "sample"
STRAGGLER = "straggler"
WARNING = "warning"
CHECKPOINT = "checkpoint"
MEMORY = "memory"
END = "end"
ERROR = "error"
STATE = "state"
RETRY = "retry"
DEVICES = "devices"

OBJECTIVE_FIGURES = (
    "rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "nll",
    "log_odds_ratio",
)  # fmt: skip
"""A preference objective's figures (`StepEvent` and `EvalEvent` alike, None for another
objective): DPO/KTO rewards, ORPO's nll and log odds. Listed, not found by reflection: the live
view and the metric loggers show a new event field only when it is named here."""
GRPO_FIGURES = (
    "reward", "reward_std", "completion_length", "completion_length_min",
    "completion_length_max", "completion_truncated", "clipped", "kl", "generation_s",
)  # fmt: skip
"""GRPO's step figures (`StepEvent`, None for another objective): the mean reward and its
spread, the completions' length (mean, min, max, share cut at the limit), the clipped share, the
KL and the seconds spent generating; each reward function's mean is ``reward_<name>`` beside
them."""


@dataclass(kw_only=True)
class Event:
    """Every event: its type (a class constant) and when it happened."""

    TYPE: ClassVar[str] = ""
    time: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        """The JSON line's object: ``type``, then every field (None fields are kept)."""
        return {"type": self.TYPE, **{f.name: getattr(self, f.name) for f in fields(self)}}


@dataclass(kw_only=True)
class StartEvent(Event):
    """Rank 0, once the model, data and strategy are set up (again on every resume)."""

    TYPE: ClassVar[str] = START
    run_id: str | None = None
    world_size: int = 1
    method: str = ""
    distribution: str = ""
    device: str = ""
    dtype: str = ""
    total_steps: int = 0
    start_step: int = 0
    resumed_from: str | None = None
    """The checkpoint folder resumed from, or None for a fresh start."""
    params: int = 0
    trainable_params: int = 0
    micro_batch: int = 1
    grad_accum: int = 1
    effective_batch: int = 1
    seq_len: int = 0
    tokens_per_step: int = 0
    samples: int = 0
    """Training blocks per epoch."""
    eval_blocks: int = 0
    """Blocks of eval data (validation while training); 0 without any."""
    eval_every: int = 0
    """``train.eval_every`` (0: only at the end) when there is eval data."""
    data_format: str = ""
    """The training data's format, ``auto`` resolved: the prompt format the model learns."""
    objective: str = "sft"
    """``train.objective``: sft, dpo, orpo or kto."""
    reference: str | None = None
    """DPO/KTO: where the reference log-probabilities come from (adapters, precompute, copy)."""
    pids: list[int] = field(default_factory=list)
    """Every rank's worker pid, by global rank."""
    peak_memory_kind: str = ""
    estimate: dict[str, int] | None = None
    """The plan's per_device_bytes."""
    estimate_bytes: int | None = None
    attention: str = ""
    """The attention kernel the model loaded with: "homelab_packed" or "flash_attention_2" (its
    route on packed segments, counted, is in the first step event's ``attention_routes``)."""
    attention_reason: str = ""
    """Why that kernel (`homelab_dp.planning.attention_rule`): the card, the dtype, flash-attn."""
    packing: str = ""
    """``data.pack``'s check on the real model (`homelab_dp.train.model.packing_check`): "exact"
    (one packed block gave its samples' logits), "off" (data.pack = false)."""
    packing_error: float | None = None
    """The check's largest logit difference, packed against one by one (None: not checked)."""
    sequence_parallel: int = 1
    """Ranks every sequence is split over (`homelab_dp.train.parallelism.sequence_parallel`; 1: whole
    sequences); the all-to-alls' seconds are in each step event's ``comm_seconds``."""


@dataclass(kw_only=True)
class MicroEvent(Event):
    """Rank 0, after each micro-step of an accumulating optimizer step."""

    TYPE: ClassVar[str] = MICRO
    step: int = 0
    """The optimizer step being accumulated (1-based)."""
    micro_step: int = 0
    grad_accum: int = 1


@dataclass(kw_only=True)
class StepEvent(Event):
    """Rank 0, every ``train.log_every`` optimizer steps and at the last one."""

    TYPE: ClassVar[str] = STEP
    step: int = 0
    total_steps: int = 0
    epoch: float = 0.0
    loss: float | None = None
    """Token-weighted mean loss over the whole effective batch."""
    lr: float | None = None
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    micro_batch: int = 1
    grad_accum: int = 1
    world_size: int = 1
    effective_batch: int = 1
    step_time_s: float | None = None
    rank_step_times_s: list[float] = field(default_factory=list)
    peak_memory_bytes: list[int] = field(default_factory=list)
    """One per rank."""
    peak_memory_kind: str = ""
    tokens: int = 0
    """Real (non-pad) target tokens so far."""
    samples: int = 0
    mfu: float | None = None
    """Model FLOPs utilisation, 0..1 (`planning.flops`); None on the CPU or an unknown GPU."""
    aux_loss: float | None = None
    """A MoE model's router auxiliary (load-balancing) loss, unweighted: the mean over the
    micro-batches since the last step event (``router_aux_loss_coef`` × it is trained on, beside
    ``loss``); None for a model without one."""
    attention_routes: dict[str, int] | None = None
    """The first step event of a launch only: the routes ``homelab_packed`` took on this rank
    since the loop began, attention calls counted by route ("varlen", "sdpa",
    "sdpa-repeat-kv"; `homelab_dp.planning.attention_rule.packed_kernel`): what ran, not what
    the start event's rule assumed. Empty under another kernel (FlashAttention-2)."""
    rewards_chosen: float | None = None
    """DPO/KTO: the mean implicit reward β·(log π − log π_ref) of the chosen (KTO: desirable)
    answers of the effective batch; None for other objectives."""
    rewards_rejected: float | None = None
    """DPO/KTO: the same for the rejected (KTO: undesirable) answers."""
    reward_margin: float | None = None
    """DPO: the mean of chosen − rejected reward over the pairs."""
    reward_accuracy: float | None = None
    """DPO: the share of pairs whose chosen reward is above the rejected one (0..1)."""
    nll: float | None = None
    """ORPO: the chosen answers' negative log-likelihood per target token."""
    log_odds_ratio: float | None = None
    """ORPO: the mean log odds ratio of chosen over rejected."""
    comm_seconds: float | None = None
    """Seconds this step's ranks spent in gradient communication (the mean over ranks of the
    collectives' time), measured on logged steps only; None with one process."""
    compute_seconds: float | None = None
    """Seconds of this step not spent waiting on communication (step time − exposed
    communication, mean over ranks)."""
    reward: float | None = None
    """GRPO: the mean of the completions' weighted total reward over the effective batch."""
    reward_std: float | None = None
    """GRPO: the standard deviation of that total over the batch."""
    reward_functions: dict[str, float] = field(default_factory=dict)
    """GRPO: each reward function's mean, written as ``reward_<name>`` keys of the JSON line."""
    completion_length: float | None = None
    """GRPO: the completions' mean length in tokens (their eos included)."""
    completion_length_min: float | None = None
    completion_length_max: float | None = None
    completion_truncated: float | None = None
    """GRPO: the share of completions cut at grpo.max_completion_tokens."""
    clipped: float | None = None
    """GRPO: the share of completion tokens whose importance ratio was clipped."""
    kl: float | None = None
    """GRPO (beta > 0): the mean KL estimate to the reference per completion token."""
    generation_s: float | None = None
    """GRPO: seconds this step spent generating (rank 0)."""

    def to_json(self) -> dict[str, Any]:
        """As every event's, with ``reward_functions`` as ``reward_<name>`` keys."""
        out = super().to_json()
        for name, value in out.pop("reward_functions").items():
            out[f"reward_{name}"] = value
        return out


@dataclass(kw_only=True)
class EvalEvent(Event):
    """Rank 0, after each evaluation of the eval data (``train.eval_every`` and at the end)."""

    TYPE: ClassVar[str] = EVAL
    step: int = 0
    """The optimizer steps done when the model was evaluated."""
    loss: float | None = None
    """Mean negative log-likelihood per target token of the whole eval data (nats)."""
    perplexity: float | None = None
    """exp(loss); None where it overflows a float."""
    tokens: int = 0
    """Target tokens evaluated."""
    seconds: float = 0.0
    best: bool = False
    """The lowest eval loss of the run so far (``train.keep_best`` keeps this step)."""
    pairs: int = 0
    """DPO/ORPO/KTO: the pairs (KTO: completions) evaluated; ``loss`` is then the objective's
    mean loss over them and ``tokens`` their target tokens."""
    rewards_chosen: float | None = None
    """As in the step event, over the eval data (DPO/KTO)."""
    rewards_rejected: float | None = None
    reward_margin: float | None = None
    reward_accuracy: float | None = None
    nll: float | None = None
    log_odds_ratio: float | None = None


@dataclass(kw_only=True)
class SampleEvent(Event):
    """Rank 0: the model's answer to one sample prompt while it trains (``train.sample_every``)."""

    TYPE: ClassVar[str] = SAMPLE
    step: int = 0
    """The optimizer steps done when the answer was generated."""
    prompt: str = ""
    """The prompt as the user wrote it (``data.sample_prompts``), or the prompt part of a data
    sample as the model saw it (template included, special tokens left out)."""
    text: str = ""
    """The generated answer (special tokens left out)."""
    tokens: int = 0
    """New tokens generated (the eos that ended the answer included)."""
    seconds: float = 0.0
    """Time this answer took to generate."""


@dataclass(kw_only=True)
class StragglerEvent(Event):
    """Rank 0, when a rank is first found slower than the others for several steps."""

    TYPE: ClassVar[str] = STRAGGLER
    step: int = 0
    rank: int = 0
    message: str = ""


@dataclass(kw_only=True)
class WarningEvent(Event):
    """Something the user should know that does not stop the run (a damaged checkpoint…)."""

    TYPE: ClassVar[str] = WARNING
    message: str = ""


@dataclass(kw_only=True)
class CheckpointEvent(Event):
    """Rank 0, once a checkpoint is complete (its marker written)."""

    TYPE: ClassVar[str] = CHECKPOINT
    step: int = 0
    path: str = ""
    seconds: float = 0.0


@dataclass(kw_only=True)
class MemoryEvent(Event):
    """Rank 0: every rank's measured peaks beside the plan's estimate."""

    TYPE: ClassVar[str] = MEMORY
    mode: str = ""
    """"measure" for `homelab-dp measure`, "run" for the tracked step of a normal run."""
    kind: str = ""
    steps: list[int] = field(default_factory=list)
    """The optimizer steps probed (1-based)."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    measured_peak_bytes: int = 0
    estimate_tensor_bytes: int | None = None
    estimate_peak_phase: str | None = None
    estimate: dict[str, int] | None = None
    error: float | None = None


@dataclass(kw_only=True)
class EndEvent(Event):
    """Rank 0, when the loop ends: completed, early_stopped, stopped or measured."""

    TYPE: ClassVar[str] = END
    reason: str = ""
    """completed | early_stopped (``train.early_stopping_patience``: a completed run, result
    saved, before its last step) | stopped | measured."""
    final_loss: float | None = None
    steps: int = 0
    seconds: float = 0.0
    final_path: str | None = None


@dataclass(kw_only=True)
class ErrorEvent(Event):
    """Any rank (or the keeper) when the run fails; ``proposal`` for an out-of-memory error."""

    TYPE: ClassVar[str] = ERROR
    message: str = ""
    hint: str | None = None
    rank: int | None = None
    kind: str = ""
    proposal: dict[str, Any] | None = None


@dataclass(kw_only=True)
class StateEvent(Event):
    """The controller or the keeper: the run's status changed."""

    TYPE: ClassVar[str] = STATE
    status: str = ""
    reason: str | None = None
    run_id: str | None = None
    resume: bool | None = None


@dataclass(kw_only=True)
class RetryEvent(Event):
    """The keeper resumes after out-of-memory with the worker's proposal (`run --auto-fit`)."""

    TYPE: ClassVar[str] = RETRY
    reason: str = ""
    """What was changed."""
    after: str = ""
    attempt: int = 1


@dataclass(kw_only=True)
class DevicesEvent(Event):
    """The monitor's sample of every device (``devices.jsonl``)."""

    TYPE: ClassVar[str] = DEVICES
    devices: list[dict[str, Any]] = field(default_factory=list)
    energy_wh: float = 0.0


EVENT_CLASSES: dict[str, type[Event]] = {
    cls.TYPE: cls
    for cls in (
        StartEvent, MicroEvent, StepEvent, EvalEvent, SampleEvent, StragglerEvent, WarningEvent,
        CheckpointEvent, MemoryEvent, EndEvent, ErrorEvent, StateEvent, RetryEvent, DevicesEvent,
    )
}  # fmt: skip
"""Event type name → its class."""


def parse_event(data: dict[str, Any]) -> Event | None:
    """The typed event of one JSON line, or None for a type this version does not know."""
    cls = EVENT_CLASSES.get(data.get("type")) if isinstance(data.get("type"), str) else None
    if cls is None:
        return None
    known = {f.name for f in fields(cls)}
    kwargs = {k: v for k, v in data.items() if k in known and v is not None}
    if cls is StepEvent:  # GRPO's reward_<name> keys
        kwargs["reward_functions"] = {k[len("reward_") :]: v for k, v in data.items()
                                      if k.startswith("reward_") and k not in known
                                      and isinstance(v, (int, float))}  # fmt: skip
    if not isinstance(kwargs.get("time", 0.0), (int, float)):
        kwargs.pop("time")
    return cls(**kwargs)
