"""`plan --find-micro-batch`: the plan at the largest micro-batch that fits, effective batch kept.

The search itself is `homelab_dp.core.fit.search_micro_batch`; this applies it to every option
of the decision tree in order (`homelab_dp.core.planner`).
"""

from __future__ import annotations

from dataclasses import replace

from homelab_dp.core.calibration import HardwareCalibration
from homelab_dp.core.fit import Fit, search_micro_batch
from homelab_dp.core.hardware import PlanHardware
from homelab_dp.core.model_spec import ModelSpec
from homelab_dp.core.planner import (
    SAFETY_MARGIN,
    Plan,
    checkpointing_options,
    evaluate,
    option_stages,
    plan,
    resolve_dtype,
    supported,
)
from homelab_dp.core.preset import Preset


def plan_largest_micro_batch(
    spec: ModelSpec,
    preset: Preset,
    hw: PlanHardware,
    calibration: HardwareCalibration | None = None,
) -> Plan:
    """Plan with the largest micro-batch that fits, accumulation keeping the effective batch.

    The options are tried in the decision tree's order (full before LoRA before QLoRA,
    checkpointing off before on, offload only after every option without it); the first that
    fits at some micro-batch takes its largest.
    """
    t = preset.train
    requested = t.micro_batch * hw.world_size * t.grad_accum
    limit = hw.budget(SAFETY_MARGIN)  # on local cards others use: what is free, less a margin
    fit: Fit | None = None
    dtype = resolve_dtype(preset, hw)
    options = [o for stage in option_stages(preset, hw) for o in stage]
    for method, dist, off, acts in options:
        if not supported(method, dist, hw, dtype, off)[0]:
            continue
        for ckpt in checkpointing_options(preset):

            def total(
                micro: int, accum: int, m: str = method, d: str = dist, c: bool = ckpt,
                o: str = off, a: bool = acts,
            ) -> int:  # fmt: skip
                cand = evaluate(spec, preset, hw, m, d, c, calibration, micro_batch=micro,
                                grad_accum=accum, offload=o, offload_activations=a)  # fmt: skip
                return cand.budget.total

            found = search_micro_batch(total, limit, requested, hw.world_size)
            fit = fit or found  # the first option's answer stands when none fits
            if found.fits:
                fit = found
                break
        if fit is not None and fit.fits:
            break
    if fit is None:  # nothing supported: plan as asked, the plan explains
        return plan(spec, preset, hw, calibration)
    # The lr was set for the preset's effective batch: keep that as the scaling reference.
    train = replace(t, micro_batch=fit.micro_batch, grad_accum=fit.grad_accum,
                    reference_batch=t.reference_batch or requested)  # fmt: skip
    p = plan(spec, replace(preset, train=train), hw, calibration)
    return replace(p, fit=fit, reasons=(*p.reasons, fit.describe()))
