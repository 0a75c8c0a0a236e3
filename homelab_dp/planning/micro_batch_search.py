"""The micro-batch search: the largest micro-batch whose per-device total fits a limit.

Pure arithmetic over a total the caller computes (`homelab_dp.planning.planner`'s
`plan_largest_micro_batch` applies it to every option of the decision tree in order, as
`homelab_dp.planning.seq_len_finder` does for the sequence length).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from homelab_dp.planning.batch_shape import BatchShape
from homelab_dp.planning.plan_result import Fit

MAX_CANDIDATES = 4096
"""Micro-batches tried at most (an effective batch larger than this per device is unusual)."""


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
        batch = BatchShape.reaching(requested_effective, micro, world_size)
        total = int(total_for(micro, batch.accum))
        ok = total <= limit
        tried.append((micro, total, ok))
        if ok and exact and batch.effective != requested_effective:
            larger = micro
        elif ok:
            best, larger = (micro, batch.accum, total), None
    if best is None:
        micro, total, _ = tried[0]
        accum = BatchShape.reaching(requested_effective, 1, world_size).accum
        return Fit(
            1, accum, world_size, requested_effective, total, int(limit), False, tuple(tried)
        )
    micro, accum, total = best
    return Fit(
        micro, accum, world_size, requested_effective, total, int(limit), True, tuple(tried), larger
    )
