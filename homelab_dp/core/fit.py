"""The micro-batch search: the largest micro-batch that fits, the effective batch kept.

Pure arithmetic over a budget function; `homelab_dp.core.finder` applies it to the planner.

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
from dataclasses import dataclass
from typing import Any

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


def search_micro_batch(
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
