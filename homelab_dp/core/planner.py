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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from homelab_dp.core.calibration import (
    HardwareCalibration,
    Measurement,
    calibration_json,
    config_key,
    measured_reasons,
)
from homelab_dp.core.hardware import PlanHardware, format_bytes
from homelab_dp.core.memory import (
    Budget,
    TrainShape,
    assumed_overhead,
    budget,
    overhead_terms,
)
from homelab_dp.core.model_spec import ModelSpec
from homelab_dp.core.preset import DISTRIBUTIONS, METHODS, Preset

if TYPE_CHECKING:
    from homelab_dp.core.fit import Fit

SAFETY_MARGIN = 0.95
"""A plan fits when its total is at most this fraction of the smallest device's memory."""

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

PLAIN = {
    "full": "full fine-tune",
    "lora": "LoRA",
    "qlora": "QLoRA (4-bit base + LoRA)",
    "ddp": "DDP (each device holds a full copy)",
    "zero1": "ZeRO-1 (optimizer state split across cards)",
    "fsdp-grad-op": "FSDP grad-op (gradients and optimizer state split)",
    "fsdp-full": "FSDP full (weights, gradients and optimizer state split)",
}


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
class LrAdvice:
    """Learning rate for the planned effective batch."""

    preset_lr: float
    reference_batch: int
    effective_batch: int
    linear: float
    sqrt: float
    rule: str
    applied: float
    warmup_steps: int

    def to_json(self) -> dict[str, Any]:
        return {
            "preset": self.preset_lr,
            "reference_batch": self.reference_batch,
            "effective_batch": self.effective_batch,
            "linear": self.linear,
            "sqrt": self.sqrt,
            "rule": self.rule,
            "applied": self.applied,
            "warmup_steps": self.warmup_steps,
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

    @property
    def fits(self) -> bool:
        return self.chosen.fits

    @property
    def world_size(self) -> int:
        return self.hardware.world_size

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.world_size * self.grad_accum

    def to_json(self) -> dict[str, Any]:
        """The `plan --json` document (field names fixed by DESIGN.md)."""
        b = self.chosen.budget
        return {
            "model": {**self.spec.summary(), "trainable_params": b.trainable_params},
            "hardware": {
                "kind": self.hardware.kind,
                "source": self.hardware.source,
                "devices": [
                    {"name": d.name, "memory_bytes": d.memory_bytes} for d in self.hardware.devices
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
        }

    def _calibration_json(self) -> dict[str, Any]:
        """Which numbers are measured on this hardware and which are estimated or assumed."""
        ov = assumed_overhead(self.hardware.kind, self.world_size)
        return calibration_json(self.calibration, self.measured, self.chosen.budget, ov)


def resolve_dtype(preset: Preset, kind: str) -> str:
    """The compute dtype: fp32 on CPU; bf16 for "auto" on CUDA."""
    if kind == "cpu":
        return "fp32"
    return "bf16" if preset.model.dtype == "auto" else preset.model.dtype


def _shape(preset: Preset, hw: PlanHardware, method: str, dist: str, ckpt: bool, **kw: Any):
    targets = preset.lora.target_modules
    return TrainShape(
        method=method,  # type: ignore[arg-type]
        distribution=dist,  # type: ignore[arg-type]
        world_size=hw.world_size,
        device=hw.kind,
        dtype=resolve_dtype(preset, hw.kind),  # type: ignore[arg-type]
        micro_batch=kw.get("micro_batch", preset.train.micro_batch),
        seq_len=kw.get("seq_len", preset.data.seq_len),
        grad_accum=kw.get("grad_accum", preset.train.grad_accum),
        activation_checkpointing=ckpt,
        optimizer=preset.train.optimizer,
        lora_r=preset.lora.r,
        lora_targets=targets if isinstance(targets, str) else tuple(targets),
        packed=preset.data.pack,
    )


def supported(method: str, dist: str, hw: PlanHardware) -> tuple[bool, str]:
    if method == "qlora" and dist != "ddp":
        return False, "QLoRA runs under DDP only (4-bit weights are not sharded)"
    if method != "full" and dist == "zero1":
        return False, "ZeRO-1 saves nothing for LoRA: the adapters' optimizer state is tiny"
    if dist != "ddp" and hw.world_size == 1:
        return False, "sharding needs more than one device"
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
    b = budget(spec, _shape(preset, hw, method, dist, ckpt, **kw), overhead)
    ok, note = supported(method, dist, hw)
    fits = ok and b.total <= SAFETY_MARGIN * hw.min_memory
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
    """Run the decision tree for ``preset`` on ``hw`` (with what was measured on it, if known)."""
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
    dtype = resolve_dtype(preset, hw.kind)
    lr = lr_advice(preset, hw.world_size)
    reasons = _reasons(spec, preset, hw, best_effort, tried, dtype)
    advice = () if chosen else tuple(_advice(spec, preset, hw, best_effort, calibration))
    measured = None
    if calibration is not None and calibration.fingerprint:
        c = best_effort
        shape = _shape(preset, hw, c.method, c.distribution, c.activation_checkpointing)
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
        reasons=tuple(reasons + _lr_reasons(lr)),
        advice=advice,
        assumptions=tuple(overhead_terms(hw.kind, calibration.overhead if calibration else None)),
        calibration=calibration,
        measured=measured,
    )


def _model_key(spec: ModelSpec) -> dict[str, Any]:
    return {**spec.summary(), "model_type": spec.model_type}


def measurement_key(spec: ModelSpec, preset: Preset, hw: PlanHardware, c: Candidate) -> dict:
    """The calibration key of candidate ``c`` (what `homelab-dp measure` stores)."""
    shape = _shape(preset, hw, c.method, c.distribution, c.activation_checkpointing)
    return config_key(_model_key(spec), shape)


def lr_advice(preset: Preset, world_size: int) -> LrAdvice:
    """Scaled learning rates when the effective batch differs from the reference batch."""
    t = preset.train
    effective = t.micro_batch * world_size * t.grad_accum
    ref = t.reference_batch or effective
    ratio = effective / ref
    linear, sqrt = t.lr * ratio, t.lr * math.sqrt(ratio)
    applied = {"none": t.lr, "linear": linear, "sqrt": sqrt}[t.lr_scaling]
    return LrAdvice(t.lr, ref, effective, linear, sqrt, t.lr_scaling, applied, t.warmup_steps)


def _lr_reasons(lr: LrAdvice) -> list[str]:
    out = [f"Effective batch {lr.effective_batch} sequences per optimizer step."]
    if lr.effective_batch != lr.reference_batch:
        out.append(
            f"The preset's lr {lr.preset_lr:g} was set for a batch of {lr.reference_batch}; for "
            f"{lr.effective_batch} the linear rule gives {lr.linear:.3g} and the square-root rule "
            f"{lr.sqrt:.3g} (using {lr.applied:.3g}, train.lr_scaling = {lr.rule!r}), "
            f"with {lr.warmup_steps} warm-up steps."
        )
    return out


def count(n: int) -> str:
    """A parameter count for people: 8.03B, 135M, 1.31M, 9.8K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _describe(c: Candidate) -> str:
    ck = " with activation checkpointing" if c.activation_checkpointing else ""
    return f"{PLAIN[c.method]} with {PLAIN[c.distribution]}{ck}"


def _reasons(
    spec: ModelSpec,
    preset: Preset,
    hw: PlanHardware,
    chosen: Candidate,
    tried: list[Candidate],
    dtype: str,
) -> list[str]:
    cap = hw.min_memory
    usable = SAFETY_MARGIN * cap
    n = hw.world_size
    where = f"{n} CPU process{'es' if n > 1 else ''}" if hw.kind == "cpu" else f"{n} GPU(s)"
    out = [
        f"{count(spec.params)} parameters ({spec.model_type}), {where}, "
        f"{format_bytes(cap)} on the smallest device ({format_bytes(usable)} usable after a "
        f"{int(round((1 - SAFETY_MARGIN) * 100))}% margin), compute in {dtype}."
    ]
    if len({d.memory_bytes for d in hw.devices}) > 1:
        out.append(
            "Mixed cards: every card gets the same share, so the smallest one limits the plan."
        )
    pinned = [
        f"{k} = {v!r}"
        for k, v in (("method", preset.train.method), ("distribution", preset.train.distribution))
        if v != "auto"
    ]
    if pinned:
        out.append("The preset pins " + " and ".join(pinned) + "; only that was considered.")
    # One line per (method, distribution) rejected, with its smallest budget.
    rejected: dict[tuple[str, str], Candidate] = {}
    for cand in tried:
        if cand is chosen:
            break
        if cand.supported and (cand.method, cand.distribution) != (
            chosen.method,
            chosen.distribution,
        ):
            rejected[(cand.method, cand.distribution)] = cand  # the last one tried is smallest
    for cand in rejected.values():
        ck = " even with activation checkpointing" if cand.activation_checkpointing else ""
        out.append(
            f"Too big: {PLAIN[cand.method]} with {PLAIN[cand.distribution]} needs "
            f"{format_bytes(cand.budget.total)} per device{ck}."
        )
    total = chosen.budget.total
    verdict = "fits" if chosen.fits else "does NOT fit"
    out.append(
        f"Chosen: {_describe(chosen)} — {format_bytes(total)} per device at the {chosen.budget.peak_phase} "
        f"peak, {verdict} ({100 * total / cap:.0f}% of {format_bytes(cap)})."
    )
    if chosen.distribution != "ddp" and chosen.fits:
        out.append(
            f"Sharding moves {format_bytes(chosen.budget.comm_bytes_per_step)} per device per step "
            "over the links between cards; NVLink or fast PCIe helps."
        )
    return out


def _advice(
    spec: ModelSpec,
    preset: Preset,
    hw: PlanHardware,
    best: Candidate,
    calibration: HardwareCalibration | None = None,
) -> list[str]:
    """What would make the run fit, each checked with the same budget arithmetic."""
    m, d, ck = best.method, best.distribution, best.activation_checkpointing
    usable = SAFETY_MARGIN * hw.min_memory
    out: list[str] = []
    t = preset.train

    def fits(**kw: Any) -> bool:
        return evaluate(spec, preset, hw, m, d, ck, calibration, **kw).budget.total <= usable

    seq = preset.data.seq_len
    while seq > 16 and not fits(seq_len=seq):
        seq //= 2
    if seq < preset.data.seq_len and fits(seq_len=seq):
        out.append(f"Shorter sequences: data.seq_len = {seq} fits (now {preset.data.seq_len}).")
    for micro in range(t.micro_batch - 1, 0, -1):
        if fits(micro_batch=micro):
            accum = math.ceil(t.micro_batch * t.grad_accum / micro)
            out.append(
                f"Smaller micro-batch with more accumulation: train.micro_batch = {micro}, "
                f"train.grad_accum = {accum} (effective batch {micro * hw.world_size * accum})."
            )
            break
    if m != "qlora" and preset.train.method not in ("auto", "qlora"):
        q = evaluate(spec, preset, hw, "qlora", "ddp", True)
        if q.fits:
            out.append(
                f"QLoRA fits: {format_bytes(q.budget.total)} per device (train.method = 'qlora')."
            )
    need = best.budget.total / SAFETY_MARGIN
    out.append(f"Larger cards: this plan needs {format_bytes(need)} per device.")
    if hw.kind == "cuda" and m == "full":
        size = hw.min_memory
        for n in range(hw.world_size + 1, 17):
            more = replace(hw, devices=tuple(hw.devices[:1]) * n)
            c = evaluate(spec, preset, more, "full", "fsdp-full", True)
            if c.fits:
                out.append(
                    f"More cards: {n} × {format_bytes(size)} fit a full fine-tune with FSDP full "
                    f"sharding ({format_bytes(c.budget.total)} per card)."
                )
                break
    if len(out) == 1:
        fixed = best.budget.weights + best.budget.optimizer + best.budget.buffers
        out.insert(
            0,
            "Neither shorter sequences nor a smaller micro-batch is enough: weights and optimizer "
            f"state alone need {format_bytes(fixed)} per device, before activations and runtime.",
        )
    return out
