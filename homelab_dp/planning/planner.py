"""The strategy planner: which method and distribution, and why, for a model on some devices.

Decision tree (a pinned method, distribution or offload in the preset is respected):

1. Full fine-tune if it fits: DDP (every card holds everything; fastest), else ZeRO-1
   (optimizer state sharded), else FSDP grad-op (gradients and optimizer sharded), else FSDP
   full (everything sharded).
2. Else LoRA (frozen base, small adapters): DDP, else FSDP grad-op, else FSDP full.
3. Else QLoRA (4-bit base): DDP, else FSDP grad-op, else FSDP full (the packed 4-bit weights
   sharded, `homelab_dp.core.memory`).
4. Only when nothing above fits, not even on the same cards idle (memory others hold is waited
   for, not offloaded around), and `train.offload` / `train.offload_activations` are
   "auto"): the same options with offload to host RAM — the optimizer state or the sharded
   parameters (FSDP only), the saved activations (any distribution) — and of those that fit
   the one that moves the fewest bytes over PCIe per step (`homelab_dp.core.offload` prices
   it). Never on the CPU, where the device is host RAM (a pinned offload is planned, at no
   cost).

Within each option activation checkpointing is tried off first, then on (when the preset says
"auto"), because it costs about a third more compute but no communication. Mixed cards are
limited by the smallest. When nothing fits, the plan says what would.

The words (the reasons for the choice, the advice when nothing fits, the learning-rate
scaling) are `homelab_dp.core.plan_reasons`; the checks of what a preset may ask of the cards
`homelab_dp.core.plan_inputs`; the answer's types and JSON `homelab_dp.core.plan_result`. This
module decides and budgets.
"""

from __future__ import annotations

from typing import Any

from homelab_dp.core.calibration import HardwareCalibration, config_key, measured_reasons
from homelab_dp.core.hardware import PlanHardware
from homelab_dp.core.held_memory import held_reasons, idle_advice, idle_choice_reason
from homelab_dp.core.host_memory import host_budget
from homelab_dp.core.memory import TrainShape, budget
from homelab_dp.core.model_spec import ModelSpec
from homelab_dp.core.offload import offload_cost
from homelab_dp.core.plan_inputs import (
    FP16_SHARDING_NOTE,
    attention_path,
    check_fp16_sharding,
    check_offload,
    resolve_dtype,
)
from homelab_dp.core.plan_reasons import (
    choice_reasons,
    fit_advice,
    host_short_reasons,
    lr_advice,
    lr_reasons,
    overhead_terms,
)
from homelab_dp.core.plan_result import SAFETY_MARGIN, Candidate, Plan
from homelab_dp.core.preset import Preset
from homelab_dp.core.vocabulary import DISTRIBUTIONS, METHODS, SHARDED

ORDER: tuple[tuple[str, str], ...] = (
    ("full", "ddp"),
    ("full", "zero1"),
    ("full", "fsdp-grad-op"),
    ("full", "fsdp-full"),
    ("lora", "ddp"),
    ("lora", "fsdp-grad-op"),
    ("lora", "fsdp-full"),
    ("qlora", "ddp"),
    ("qlora", "fsdp-grad-op"),
    ("qlora", "fsdp-full"),
)
"""The order in which the decision tree tries (method, distribution)."""


def train_shape(preset: Preset, hw: PlanHardware, method: str, dist: str, ckpt: bool, **kw: Any):
    """The memory model's shape of one option of ``preset`` on ``hw`` (``offload`` and
    ``offload_activations`` among ``kw``: none and False unless given)."""
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
        attention=attention_path(hw.kind, dtype, [d.compute_capability for d in hw.devices]),  # type: ignore[arg-type]
        target_share=kw.get("target_share", 1.0),
        offload=kw.get("offload", "none"),
        offload_activations=kw.get("offload_activations", False),
    )


def supported(
    method: str, dist: str, hw: PlanHardware, dtype: str | None = None, offload: str = "none"
) -> tuple[bool, str]:
    """Whether the worker can train ``method`` under ``dist`` on ``hw`` (and why not).

    ``dtype``: the compute dtype (`resolve_dtype`); fp16 on CUDA rules FSDP out. ``offload``
    of the optimizer or the parameters needs FSDP.
    """
    if method != "full" and dist == "zero1":
        return False, "ZeRO-1 saves nothing for LoRA: the adapters' optimizer state is tiny"
    if dist != "ddp" and hw.world_size == 1:
        return False, "sharding needs more than one device"
    if dtype == "fp16" and hw.kind == "cuda" and dist in SHARDED:
        return False, FP16_SHARDING_NOTE
    if offload != "none" and dist not in SHARDED:
        return False, f"train.offload = {offload!r} needs FSDP (its CPU offload moves shards)"
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
    """Budget one (method, distribution, checkpointing) option on ``hw``, with the offload
    ``kw`` names (``offload``, ``offload_activations``; none by default) and what it costs.

    A calibration of this hardware replaces the assumed overhead terms with measured ones.
    """
    overhead = calibration.overhead if calibration else None
    shape = train_shape(preset, hw, method, dist, ckpt, **kw)
    b = budget(spec, shape, overhead)
    ok, note = supported(method, dist, hw, shape.dtype, shape.offload)
    fits = ok and b.total <= hw.budget(SAFETY_MARGIN)
    cost = offload_cost(spec, shape, b, hw)
    return Candidate(method, dist, ckpt, b, fits, ok, note, shape.offload,
                     shape.offload_activations, cost)  # fmt: skip


def checkpointing_options(preset: Preset) -> tuple[bool, ...]:
    setting = preset.train.activation_checkpointing
    return (False, True) if setting == "auto" else (bool(setting),)


def allowed_options(preset: Preset) -> list[tuple[str, str]]:
    m, d = preset.train.method, preset.train.distribution
    pairs = [(mm, dd) for mm, dd in ORDER if (m == "auto" or mm == m) and (d == "auto" or dd == d)]
    if not pairs:  # e.g. method=lora with distribution=zero1: plan it anyway, flagged unsupported
        pairs = [(m if m != "auto" else "full", d if d != "auto" else "ddp")]
    return pairs


def offload_stages(preset: Preset, hw: PlanHardware) -> list[list[tuple[str, bool]]]:
    """The (offload, offload_activations) settings the tree tries, stage by stage.

    First the least the preset allows (nothing, unless pinned); then, for what is "auto", every
    offload, which the tree tries only when nothing in the first stage fits. On the CPU
    offload moves nothing, so "auto" never chooses it (a pinned value is still planned). The
    optimizer state and the parameters go to the host only with AdamW (the worker steps it
    there: `core.preset` refuses a pinned offload with another optimizer).
    """
    t = preset.train
    o, a = t.offload, t.offload_activations
    first = ("none" if o == "auto" else o, False if a == "auto" else bool(a))
    if hw.kind != "cuda":
        return [[first]]
    host_step = t.optimizer == "adamw"
    offs = (("none", "optimizer", "params") if host_step else ("none",)) if o == "auto" else (o,)
    acts = (False, True) if a == "auto" else (bool(a),)
    rest = [(oo, aa) for aa in acts for oo in offs if (oo, aa) != first]
    return [[first], rest] if rest else [[first]]


def option_stages(preset: Preset, hw: PlanHardware) -> list[list[tuple[str, str, str, bool]]]:
    """(method, distribution, offload, offload_activations) in the tree's order, by stage
    (`offload_stages`); offload of the optimizer or parameters under FSDP only."""
    pairs = allowed_options(preset)
    stages = []
    for settings in offload_stages(preset, hw):
        opts = [(m, d, o, a) for m, d in pairs for o, a in settings if o == "none" or d in SHARDED]
        if opts:
            stages.append(opts)
    return stages


def offloading(c: Candidate) -> bool:
    return c.offload != "none" or c.offload_activations


def _decide(spec, preset, hw, dtype, calibration, host_available, *, offload: bool = True):
    """The decision tree: (chosen or None, every candidate tried, the first stage's, the
    candidates refused for host RAM). In each stage the options go in the tree's order, each
    with checkpointing off then on; the fitting one that moves the fewest bytes over PCIe per
    step wins (without offload: the first that fits). ``offload`` False: the first stage only
    (what the preset pins, else nothing offloaded)."""
    ckpts = checkpointing_options(preset)
    tried: list[Candidate] = []
    first: list[Candidate] = []
    short: list[tuple[Candidate, int]] = []
    stages = option_stages(preset, hw)
    for i, stage in enumerate(stages if offload else stages[:1]):
        fitting: list[Candidate] = []
        for m, d, o, a in stage:
            if i and not supported(m, d, hw, dtype, o)[0]:
                continue  # a later stage lists only what could be chosen
            for ck in ckpts:
                c = evaluate(spec, preset, hw, m, d, ck, calibration, offload=o,
                             offload_activations=a)  # fmt: skip
                tried.append(c)
                need = _host_short(spec, preset, hw, c, host_available) if c.fits else None
                if need is not None:
                    short.append((c, need))
                elif c.fits:
                    fitting.append(c)
                    break
            if fitting and fitting[-1].budget.pcie_bytes_per_step == 0:
                break  # nothing crosses PCIe: the first that fits stands
        if i == 0:
            first = list(tried)
        if fitting:
            return min(fitting, key=lambda c: c.budget.pcie_bytes_per_step), tried, first, short
    return None, tried, first, short


def _host_short(spec, preset, hw, c: Candidate, available: int | None) -> int | None:
    """The host peak of an offloading option whose host RAM the machine cannot hold, else None
    (and None when the machine's RAM is not known)."""
    if available is None or not offloading(c):
        return None
    shape = train_shape(preset, hw, c.method, c.distribution, c.activation_checkpointing,
                        offload=c.offload, offload_activations=c.offload_activations)  # fmt: skip
    host = host_budget(spec, shape, c.budget, merge=preset.train.merge, available=available)
    return None if host.fits else host.total_bytes


def plan(
    spec: ModelSpec,
    preset: Preset,
    hw: PlanHardware,
    calibration: HardwareCalibration | None = None,
    *,
    host_available: int | None = None,
) -> Plan:
    """Run the decision tree for ``preset`` on ``hw`` (with what was measured on it, if known).

    ``host_available``: the machine's RAM, when known; an offloading option whose host RAM
    does not fit it is not chosen (`homelab_dp.core.host_plan.with_host` passes it).
    Raises `PresetError` for a dtype the planned cards cannot train in (`resolve_dtype`), and
    for a pinned choice they cannot train (`check_fp16_sharding`, `check_offload`).
    """
    dtype = resolve_dtype(preset, hw)
    check_fp16_sharding(preset, hw, dtype)
    check_offload(preset, hw, dtype)
    # Memory other processes hold is waited for (`run --queue`), never offloaded around: offload
    # is tried only when the same cards, idle, would not hold the run without it either.
    offload = (
        not hw.limited(SAFETY_MARGIN)
        or _decide(spec, preset, hw.idle(), dtype, calibration, host_available, offload=False)[0]
        is None
    )
    chosen, tried, first, short = _decide(spec, preset, hw, dtype, calibration, host_available,
                                          offload=offload)  # fmt: skip
    usable = [c for c in tried if c.supported and all(c is not x for x, _ in short)]
    best_effort = chosen or min(usable, key=lambda c: c.budget.total, default=tried[-1])
    # Every candidate, each with the checkpointing setting the plan would use for it, under the
    # first stage's offload; and the chosen one, when it offloads more.
    ckpts = checkpointing_options(preset)
    off, acts = offload_stages(preset, hw)[0][0]
    candidates = []
    for method in METHODS:
        for dist in DISTRIBUTIONS:
            options = [evaluate(spec, preset, hw, method, dist, c, calibration, offload=off,
                                offload_activations=acts) for c in ckpts]  # fmt: skip
            fitting = [c for c in options if c.fits]
            candidates.append(fitting[0] if fitting else options[-1])
    if _option_key(best_effort) not in {_option_key(c) for c in candidates}:
        candidates.append(best_effort)
    lr = lr_advice(preset, hw.world_size)
    later = chosen is not None and all(chosen is not c for c in first)
    reasons = choice_reasons(spec, preset, hw, best_effort, first if later else tried, dtype,
                             SAFETY_MARGIN, only_offload=later)  # fmt: skip
    reasons += host_short_reasons(short, host_available)
    reasons = [*hw.notes, *reasons]  # what choosing the devices decided (a MIG slice) comes first
    advice: tuple[str, ...] = ()
    if not chosen:
        advice = tuple(
            fit_advice(spec, preset, hw, best_effort, evaluate, SAFETY_MARGIN, calibration)
        )
    idle = None
    if hw.limited(SAFETY_MARGIN):  # others hold memory: what would the same cards idle take?
        idle = plan(spec, preset, hw.idle(), calibration, host_available=host_available).chosen
        reasons += held_reasons(hw, SAFETY_MARGIN)
        if chosen and idle.fits and _option_key(idle) != _option_key(chosen):
            reasons.append(idle_choice_reason(idle))
        if not chosen and idle.fits:
            advice = (idle_advice(hw, SAFETY_MARGIN, idle), *advice)
    measured = None
    if calibration is not None and calibration.fingerprint:
        measured = calibration.match(measurement_key(spec, preset, hw, best_effort))
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


def _option_key(c: Candidate) -> tuple[str, str, bool, str, bool]:
    return (c.method, c.distribution, c.activation_checkpointing, c.offload, c.offload_activations)


def _model_key(spec: ModelSpec) -> dict[str, Any]:
    return {**spec.summary(), "model_type": spec.model_type}


def measurement_key(spec: ModelSpec, preset: Preset, hw: PlanHardware, c: Candidate) -> dict:
    """The calibration key of candidate ``c`` (what `homelab-dp measure` stores). Offload that
    is off stays out of the key, so what was measured before offload existed still matches."""
    shape = train_shape(preset, hw, c.method, c.distribution, c.activation_checkpointing,
                        offload=c.offload, offload_activations=c.offload_activations)  # fmt: skip
    key = config_key(_model_key(spec), shape)
    if shape.offload == "none":
        key["shape"].pop("offload", None)
    if not shape.offload_activations:
        key["shape"].pop("offload_activations", None)
    return key
