"""The micro-batch finder: the largest micro-batch that fits, the effective batch kept.

The preset asks for an effective batch E = micro × world × accumulation. For a micro-batch m the
accumulation is ceil(E / (m × world)), so the effective batch stays E when m × world divides E and
becomes the next multiple above it otherwise. By default only micro-batches that keep E exactly
are chosen (the learning rate, the schedule, the data position of checkpoints and the OOM retry
all assume it); a larger micro-batch that fits only by rounding E up is named in the plan, and
``exact=False`` takes it, saying so. Memory is not monotonic in m —
accumulation keeps every gradient alive during the backward pass, and a micro-batch large enough
to need none drops them — so every m from 1 to ceil(E / world) is budgeted (pure arithmetic,
microseconds each) and the largest that fits under the limit wins.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from homelab_dp.core.calibration import HardwareCalibration
    from homelab_dp.core.hardware import PlanHardware
    from homelab_dp.core.model_spec import ModelSpec
    from homelab_dp.core.planner import Plan
    from homelab_dp.core.preset import Preset

MAX_CANDIDATES = 4096
"""Micro-batches tried at most (an effective batch larger than this per device is unusual)."""


def accumulation_for(effective: int, micro: int, world: int) -> int:
    """Accumulation steps that reach at least ``effective`` sequences per optimizer step."""
    return max(1, math.ceil(effective / (micro * world)))


@dataclass(frozen=True)
class Fit:
    """The finder's answer for one (method, distribution, checkpointing) option."""

    micro_batch: int
    grad_accum: int
    world_size: int
    requested_effective_batch: int
    total_bytes: int
    """Per-device total (tensors and overhead) at the chosen micro-batch."""
    limit_bytes: int
    """What a device may use: its memory times the safety margin."""
    fits: bool
    tried: tuple[tuple[int, int, bool], ...] = ()
    """(micro-batch, per-device total, fits) for every micro-batch budgeted."""
    larger_inexact: int | None = None
    """A larger micro-batch that fits but would round the effective batch up (exact mode)."""

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.world_size * self.grad_accum

    @property
    def exact(self) -> bool:
        """Whether the effective batch is exactly the one the preset asked for."""
        return self.effective_batch == self.requested_effective_batch

    def describe(self) -> str:
        """One plain-words line for the plan's reasons."""
        if not self.fits:
            return (
                "Micro-batch finder: not even a micro-batch of 1 fits "
                f"({self.total_bytes / 2**30:.2f} GiB per device against "
                f"{self.limit_bytes / 2**30:.2f} GiB usable)."
            )
        out = (
            f"Micro-batch finder: {self.micro_batch} is the largest micro-batch that fits "
            f"({self.total_bytes / 2**30:.2f} of {self.limit_bytes / 2**30:.2f} GiB usable per "
            f"device); accumulation {self.grad_accum} gives an effective batch of "
            f"{self.effective_batch}"
        )
        if self.exact:
            out += ", as the preset asked."
            if self.larger_inexact:
                m = self.larger_inexact
                e = m * self.world_size * accumulation_for(self.requested_effective_batch, m,
                                                           self.world_size)  # fmt: skip
                out += f" ({m} would fit too, but would round the effective batch up to {e}.)"
            return out
        return (
            out + f" — the preset asked for {self.requested_effective_batch}, which "
            f"{self.micro_batch} × {self.world_size} device(s) does not divide, so it is "
            "rounded up to the next multiple."
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "effective_batch": self.effective_batch,
            "requested_effective_batch": self.requested_effective_batch,
            "exact": self.exact,
            "fits": self.fits,
            "total_bytes": self.total_bytes,
            "limit_bytes": self.limit_bytes,
            "largest_tried": max((m for m, _, _ in self.tried), default=self.micro_batch),
            "larger_inexact": self.larger_inexact,
        }


def find_micro_batch(
    total_for: Callable[[int, int], int],
    limit: float,
    requested_effective: int,
    world_size: int,
    max_micro: int | None = None,
    exact: bool = True,
) -> Fit:
    """The largest micro-batch m with ``total_for(m, accumulation) <= limit``.

    ``exact``: only micro-batches whose accumulation reaches E exactly (m × world divides E).

    ``total_for(micro, grad_accum)`` is the per-device total of the plan with those values.
    Micro-batches beyond ceil(E / world) are not tried: one optimizer step would then hold more
    than the preset's effective batch. Without any that fits, the answer is micro-batch 1 with
    ``fits`` false.
    """
    if requested_effective < 1 or world_size < 1:
        raise ValueError("the effective batch and the world size must be positive")
    top = math.ceil(requested_effective / world_size)
    top = min(top, max_micro or top, MAX_CANDIDATES)
    tried: list[tuple[int, int, bool]] = []
    best: tuple[int, int, int] | None = None
    larger: int | None = None
    for micro in range(1, top + 1):
        accum = accumulation_for(requested_effective, micro, world_size)
        total = int(total_for(micro, accum))
        ok = total <= limit
        tried.append((micro, total, ok))
        if ok and exact and micro * world_size * accum != requested_effective:
            larger = micro
        elif ok:
            best, larger = (micro, accum, total), None
    if best is None:
        micro, total, _ = tried[0]
        accum = accumulation_for(requested_effective, 1, world_size)
        return Fit(1, accum, world_size, requested_effective, total, int(limit), False,
                   tuple(tried))  # fmt: skip
    micro, accum, total = best
    return Fit(micro, accum, world_size, requested_effective, total, int(limit), True,
               tuple(tried), larger)  # fmt: skip


def plan_micro_batch(
    spec: ModelSpec,
    preset: Preset,
    hw: PlanHardware,
    calibration: HardwareCalibration | None = None,
) -> Plan:
    """Plan with the largest micro-batch that fits, accumulation keeping the effective batch.

    The options are tried in the decision tree's order (full before LoRA before QLoRA,
    checkpointing off before on); the first that fits at some micro-batch takes its largest.
    """
    from homelab_dp.core.planner import (
        SAFETY_MARGIN,
        _allowed,
        _ckpt_options,
        _supported,
        evaluate,
        plan,
    )

    t = preset.train
    requested = t.micro_batch * hw.world_size * t.grad_accum
    limit = SAFETY_MARGIN * hw.min_memory
    fit: Fit | None = None
    for method, dist in _allowed(preset):
        if not _supported(method, dist, hw)[0]:
            continue
        for ckpt in _ckpt_options(preset):

            def total(
                micro: int, accum: int, m: str = method, d: str = dist, c: bool = ckpt
            ) -> int:
                cand = evaluate(spec, preset, hw, m, d, c, calibration, micro_batch=micro,
                                grad_accum=accum)  # fmt: skip
                return cand.budget.total

            found = find_micro_batch(total, limit, requested, hw.world_size)
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
