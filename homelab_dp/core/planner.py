"""The strategy planner: which method and distribution, and why, for a model on some devices.

Decision tree (a pinned method or distribution in the preset is respected):

1. Full fine-tune if it fits: DDP (every card holds everything; fastest), else ZeRO-1
   (optimizer state sharded), else FSDP grad-op (gradients and optimizer sharded), else FSDP
   full (everything sharded).
2. Else LoRA (frozen base, small adapters): DDP, else FSDP grad-op, else FSDP full.
3. Else QLoRA (4-bit base) under DDP.

Within each step activation checkpointing is tried off first, then on (when the preset says
"auto"), because it costs about a third more compute but no communication. Mixed cards are
limited by the smallest. When nothing fits, the plan says what would.

The words (the reasons for the choice, the advice when nothing fits, the learning-rate
scaling) are `homelab_dp.core.plan_reasons`; this module decides and budgets.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from homelab_dp.core.calibration import (
    HardwareCalibration,
    Measurement,
    calibration_json,
    config_key,
    measured_reasons,
)
from homelab_dp.core.hardware import (
    BF16_MIN_CAPABILITY,
    PlanHardware,
    format_capability,
)
from homelab_dp.core.held_memory import held_reasons, idle_advice, idle_choice_reason
from homelab_dp.core.host_memory import HostBudget
from homelab_dp.core.memory import (
    Budget,
    TrainShape,
    assumed_overhead,
    budget,
)
from homelab_dp.core.model_spec import ModelSpec
from homelab_dp.core.plan_reasons import (
    LrAdvice,
    choice_reasons,
    fit_advice,
    lr_advice,
    lr_reasons,
    overhead_terms,
)
from homelab_dp.core.preset import Preset
from homelab_dp.core.vocabulary import DISTRIBUTIONS, METHODS, SHARDED
from homelab_dp.errors import PresetError

if TYPE_CHECKING:
    from homelab_dp.core.fit import Fit

SAFETY_MARGIN = 0.95
"""A plan fits when its total is at most this fraction of the smallest device's memory (and,
on a local card others use, at most its free memory less a margin: `PlanHardware.budget`)."""

ORDER: tuple[tuple[str, str], ...] = (
    ("full", "ddp"),
    ("full", "zero1"),
    ("full", "fsdp-grad-op"),
    ("full", "fsdp-full"),
    ("lora", "ddp"),
    ("lora", "fsdp-grad-op"),
    ("lora", "fsdp-full"),
    ("qlora", "ddp"),
)
"""The order in which the decision tree tries (method, distribution)."""

FP16_SHARDING_NOTE = (
    "FSDP needs bf16: the worker scales the fp16 loss (GradScaler) under DDP and ZeRO-1 only"
)
"""Why FSDP is not a candidate when the plan computes in fp16."""


@dataclass(frozen=True)
class Candidate:
    """One (method, distribution, checkpointing) option with its budget."""

    method: str
    distribution: str
    activation_checkpointing: bool
    budget: Budget
    fits: bool
    supported: bool = True
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "distribution": self.distribution,
            "activation_checkpointing": self.activation_checkpointing,
            "fits": self.fits,
            "supported": self.supported,
            "peak_phase": self.budget.peak_phase,
            "phase_tensor_bytes": dict(self.budget.phases),
            "per_device_bytes": self.budget.per_device_bytes(),
            "comm_bytes_per_step": self.budget.comm_bytes_per_step,
            "note": self.note,
        }


@dataclass(frozen=True)
class Plan:
    """The planner's answer."""

    spec: ModelSpec
    hardware: PlanHardware
    chosen: Candidate
    candidates: tuple[Candidate, ...]
    micro_batch: int
    grad_accum: int
    seq_len: int
    dtype: str
    lr: LrAdvice
    reasons: tuple[str, ...]
    advice: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = field(default=())
    calibration: HardwareCalibration | None = None
    """What was measured on this hardware (None: nothing looked up, e.g. in tests)."""
    measured: Measurement | None = None
    """A measurement of exactly the chosen configuration on this hardware, if there is one."""
    fit: Fit | None = None
    """The micro-batch finder's answer, when it chose the micro-batch."""
    host: HostBudget | None = None
    """Host RAM of loading, saving and merging (`with_host`); None: not looked at."""
    idle: Candidate | None = None
    """What the plan would choose on the same cards idle, when other processes hold memory
    that cuts a card's budget (None: every card budgeted whole, or nothing held)."""

    @property
    def fits(self) -> bool:
        """The chosen option fits the devices, and the machine's RAM holds its host peaks."""
        return self.chosen.fits and (self.host is None or self.host.fits)

    @property
    def fits_when_idle(self) -> bool:
        """The run would fit once the other processes on its cards are gone (True when it
        fits now: an idle card budgets at least as much)."""
        idle_fits = self.idle.fits if self.idle is not None else self.chosen.fits
        return (self.chosen.fits or idle_fits) and (self.host is None or self.host.fits)

    @property
    def world_size(self) -> int:
        return self.hardware.world_size

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.world_size * self.grad_accum

    def to_json(self) -> dict[str, Any]:
        """The `plan --json` document.

        Its field names are an interface, not internals: the renderer and the TUI read them,
        scripts read `plan --json`, and each run's spec carries the document.
        """
        b = self.chosen.budget
        return {
            "model": {**self.spec.summary(), "trainable_params": b.trainable_params},
            "hardware": {
                "kind": self.hardware.kind,
                "source": self.hardware.source,
                "devices": [
                    {
                        "name": d.name,
                        "memory_bytes": d.memory_bytes,
                        "compute_capability": (
                            list(d.compute_capability) if d.compute_capability else None
                        ),
                        "free_bytes": d.free_bytes,
                        "budget_bytes": d.budget(SAFETY_MARGIN),
                        "processes": [asdict(p) for p in d.processes or ()],
                    }
                    for d in self.hardware.devices
                ],
            },
            "training": {
                "micro_batch": self.micro_batch,
                "grad_accum": self.grad_accum,
                "world_size": self.world_size,
                "effective_batch": self.effective_batch,
                "seq_len": self.seq_len,
                "activation_checkpointing": self.chosen.activation_checkpointing,
                "dtype": self.dtype,
            },
            "method": self.chosen.method,
            "distribution": self.chosen.distribution,
            "fits": self.fits,
            "fits_when_idle": self.fits_when_idle,
            "peak_phase": b.peak_phase,
            "phase_tensor_bytes": dict(b.phases),
            "per_device_bytes": b.per_device_bytes(),
            "comm_bytes_per_step": b.comm_bytes_per_step,
            "lr": self.lr.to_json(),
            "candidates": [c.to_json() for c in self.candidates],
            "reasons": list(self.reasons),
            "advice": list(self.advice),
            "assumptions": list(self.assumptions),
            "calibration": self._calibration_json(),
            "micro_batch_finder": self.fit.to_json() if self.fit else None,
            "host": self.host.to_json() if self.host else None,
        }

    def _calibration_json(self) -> dict[str, Any]:
        """Which numbers are measured on this hardware and which are estimated or assumed."""
        ov = assumed_overhead(self.hardware.kind, self.world_size)
        return calibration_json(self.calibration, self.measured, self.chosen.budget, ov)


def resolve_dtype(preset: Preset, hw: PlanHardware) -> str:
    """The compute dtype of ``preset`` on ``hw``, decided from the planned cards.

    fp32 on the CPU. On CUDA, "auto" is bf16 when every planned card has compute capability
    8.0 (Ampere) or newer, else fp16, which the worker trains with dynamic loss scaling (a
    GradScaler); a card whose capability is not known (a what-if ``--gpus 2x24GiB``, or NVML
    did not say) counts as new enough. A pinned dtype is kept, except that "bf16" on a card
    below 8.0 is a `PresetError` naming ``model.dtype`` and the card.
    """
    if hw.kind == "cpu":
        return "fp32"
    old = hw.below_capability(BF16_MIN_CAPABILITY)
    wanted = preset.model.dtype
    if wanted == "auto":
        return "fp16" if old else "bf16"
    if wanted == "bf16" and old:
        first = old[0]
        raise PresetError(
            f"model.dtype = 'bf16': {hw.label(first)} is compute capability "
            f"{format_capability(hw.devices[first].compute_capability)}, and bf16 needs "
            f"{format_capability(BF16_MIN_CAPABILITY)} (Ampere) or newer",
            hint='set model.dtype = "auto" (fp16 with loss scaling on this card) or "fp16", '
            "e.g. --set model.dtype=auto",
        )
    return wanted


def _check_fp16_sharding(preset: Preset, hw: PlanHardware, dtype: str) -> None:
    """A pinned FSDP distribution cannot train in fp16: refuse it before planning."""
    dist = preset.train.distribution
    if hw.kind != "cuda" or dtype != "fp16" or dist not in SHARDED:
        return
    old = hw.below_capability(BF16_MIN_CAPABILITY)
    why = (
        f"model.dtype = 'auto' gives fp16 on {hw.label(old[0])}, compute capability "
        f"{format_capability(hw.devices[old[0]].compute_capability)}"
        if preset.model.dtype == "auto" and old
        else f"model.dtype = {preset.model.dtype!r}"
    )
    raise PresetError(
        f"train.distribution = {dist!r} cannot train in fp16 ({why}): {FP16_SHARDING_NOTE}",
        hint="set train.distribution = 'auto', 'ddp' or 'zero1' (fp16 with loss scaling)"
        + ("" if old else ", or model.dtype = 'bf16'"),
    )


def attention_path(device: str, dtype: str) -> str:
    """The attention kernel the worker will load with (`train.attention`): FlashAttention on
    CUDA in bf16/fp16 when flash_attn is installed here (found, not imported), else SDPA."""
    if device != "cuda" or dtype not in ("bf16", "fp16"):
        return "sdpa"
    try:
        found = importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):  # a broken or half-installed package
        found = False
    return "flash_attention_2" if found else "sdpa"


def train_shape(preset: Preset, hw: PlanHardware, method: str, dist: str, ckpt: bool, **kw: Any):
    """The memory model's shape of one option of ``preset`` on ``hw``."""
    targets = preset.lora.target_modules
    dtype = resolve_dtype(preset, hw)
    return TrainShape(
        method=method,  # type: ignore[arg-type]
        distribution=dist,  # type: ignore[arg-type]
        world_size=hw.world_size,
        device=hw.kind,
        dtype=dtype,  # type: ignore[arg-type]
        micro_batch=kw.get("micro_batch", preset.train.micro_batch),
        seq_len=kw.get("seq_len", preset.data.seq_len),
        grad_accum=kw.get("grad_accum", preset.train.grad_accum),
        activation_checkpointing=ckpt,
        optimizer=preset.train.optimizer,
        lora_r=preset.lora.r,
        lora_targets=targets if isinstance(targets, str) else tuple(targets),
        packed=preset.data.pack,
        attention=attention_path(hw.kind, dtype),  # type: ignore[arg-type]
        target_share=kw.get("target_share", 1.0),
    )


def supported(
    method: str, dist: str, hw: PlanHardware, dtype: str | None = None
) -> tuple[bool, str]:
    """Whether the worker can train ``method`` under ``dist`` on ``hw`` (and why not).

    ``dtype``: the compute dtype (`resolve_dtype`); fp16 on CUDA rules FSDP out.
    """
    if method == "qlora" and dist != "ddp":
        return False, "QLoRA runs under DDP only (4-bit weights are not sharded)"
    if method != "full" and dist == "zero1":
        return False, "ZeRO-1 saves nothing for LoRA: the adapters' optimizer state is tiny"
    if dist != "ddp" and hw.world_size == 1:
        return False, "sharding needs more than one device"
    if dtype == "fp16" and hw.kind == "cuda" and dist in SHARDED:
        return False, FP16_SHARDING_NOTE
    return True, ""


def evaluate(
    spec: ModelSpec,
    preset: Preset,
    hw: PlanHardware,
    method: str,
    dist: str,
    ckpt: bool,
    calibration: HardwareCalibration | None = None,
    **kw: Any,
) -> Candidate:
    """Budget one (method, distribution, checkpointing) option on ``hw``.

    A calibration of this hardware replaces the assumed overhead terms with measured ones.
    """
    overhead = calibration.overhead if calibration else None
    b = budget(spec, train_shape(preset, hw, method, dist, ckpt, **kw), overhead)
    ok, note = supported(method, dist, hw, resolve_dtype(preset, hw))
    fits = ok and b.total <= hw.budget(SAFETY_MARGIN)
    return Candidate(method, dist, ckpt, b, fits, ok, note)


def checkpointing_options(preset: Preset) -> tuple[bool, ...]:
    setting = preset.train.activation_checkpointing
    return (False, True) if setting == "auto" else (bool(setting),)


def allowed_options(preset: Preset) -> list[tuple[str, str]]:
    m, d = preset.train.method, preset.train.distribution
    pairs = [(mm, dd) for mm, dd in ORDER if (m == "auto" or mm == m) and (d == "auto" or dd == d)]
    if not pairs:  # e.g. method=lora with distribution=zero1: plan it anyway, flagged unsupported
        pairs = [(m if m != "auto" else "full", d if d != "auto" else "ddp")]
    return pairs


def plan(
    spec: ModelSpec,
    preset: Preset,
    hw: PlanHardware,
    calibration: HardwareCalibration | None = None,
) -> Plan:
    """Run the decision tree for ``preset`` on ``hw`` (with what was measured on it, if known).

    Raises `PresetError` for a dtype the planned cards cannot train in (`resolve_dtype`).
    """
    dtype = resolve_dtype(preset, hw)
    _check_fp16_sharding(preset, hw, dtype)
    ckpts = checkpointing_options(preset)
    chosen: Candidate | None = None
    tried: list[Candidate] = []
    for method, dist in allowed_options(preset):
        for ckpt in ckpts:
            cand = evaluate(spec, preset, hw, method, dist, ckpt, calibration)
            tried.append(cand)
            if cand.fits:
                chosen = cand
                break
        if chosen:
            break
    best_effort = chosen or min(
        (c for c in tried if c.supported), key=lambda c: c.budget.total, default=tried[-1]
    )
    # Every candidate, each with the checkpointing setting the plan would use for it.
    candidates = []
    for method in METHODS:
        for dist in DISTRIBUTIONS:
            options = [evaluate(spec, preset, hw, method, dist, c, calibration) for c in ckpts]
            fitting = [c for c in options if c.fits]
            candidates.append(fitting[0] if fitting else options[-1])
    lr = lr_advice(preset, hw.world_size)
    reasons = choice_reasons(spec, preset, hw, best_effort, tried, dtype, SAFETY_MARGIN)
    advice: tuple[str, ...] = ()
    if not chosen:
        advice = tuple(
            fit_advice(spec, preset, hw, best_effort, evaluate, SAFETY_MARGIN, calibration)
        )
    idle = None
    if hw.limited(SAFETY_MARGIN):  # others hold memory: what would the same cards idle take?
        idle = plan(spec, preset, hw.idle(), calibration).chosen
        reasons += held_reasons(hw, SAFETY_MARGIN)
        if chosen and idle.fits and _option_key(idle) != _option_key(chosen):
            reasons.append(idle_choice_reason(idle))
        if not chosen and idle.fits:
            advice = (idle_advice(hw, SAFETY_MARGIN, idle), *advice)
    measured = None
    if calibration is not None and calibration.fingerprint:
        c = best_effort
        shape = train_shape(preset, hw, c.method, c.distribution, c.activation_checkpointing)
        measured = calibration.match(config_key(_model_key(spec), shape))
        reasons += measured_reasons(best_effort.budget.tensors, measured, calibration)
    return Plan(
        spec=spec,
        hardware=hw,
        chosen=best_effort,
        candidates=tuple(candidates),
        micro_batch=preset.train.micro_batch,
        grad_accum=preset.train.grad_accum,
        seq_len=preset.data.seq_len,
        dtype=dtype,
        lr=lr,
        reasons=tuple(reasons + lr_reasons(lr)),
        advice=advice,
        assumptions=tuple(overhead_terms(hw.kind, calibration.overhead if calibration else None)),
        calibration=calibration,
        measured=measured,
        idle=idle,
    )


def _option_key(c: Candidate) -> tuple[str, str, bool]:
    return (c.method, c.distribution, c.activation_checkpointing)


def _model_key(spec: ModelSpec) -> dict[str, Any]:
    return {**spec.summary(), "model_type": spec.model_type}


def measurement_key(spec: ModelSpec, preset: Preset, hw: PlanHardware, c: Candidate) -> dict:
    """The calibration key of candidate ``c`` (what `homelab-dp measure` stores)."""
    shape = train_shape(preset, hw, c.method, c.distribution, c.activation_checkpointing)
    return config_key(_model_key(spec), shape)
