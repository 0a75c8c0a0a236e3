"""The keeper's watchdog: per-rank heartbeats, and the verdict when a run stops making progress.

Every rank writes ``logs/heartbeats/rank-R.json`` — ``{rank, pid, step, micro, phase, time}`` —
when it starts a micro-step, a checkpoint or the result (`homelab_dp.train.guard`). The keeper
polls them: while any heartbeat changes, the run is making progress. When none has changed for
``train.watchdog_s`` seconds the run is stalled — a rank stopped (SIGSTOP, a debugger), stuck in
I/O, or waiting forever in a collective — and the keeper ends it rather than letting it hang.

Which rank stalled: in a data-parallel step every rank waits for the slowest at the next
collective, so the heartbeats alone often agree. The process states tell the rest: a rank in
state T (stopped) or D (uninterruptible I/O) is the culprit; otherwise the rank whose heartbeat
is behind the others'; otherwise every local rank is waiting in a collective (for a rank on
another node, or a collective that never completes).

Stdlib and psutil only: the keeper imports no torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from homelab_dp.rundir.heartbeat import read_heartbeats


@dataclass(frozen=True)
class Stall:
    """The watchdog's verdict on a run that made no progress for too long."""

    rank: int | None
    """The stalled rank, when it can be told apart (None: every local rank is waiting)."""
    pid: int | None
    step: int | None
    idle_s: float
    message: str


def _process_state(pid: int | None) -> str:
    """psutil's status of a pid ("stopped", "disk-sleep", "sleeping", …) or "gone"."""
    if not pid:
        return "gone"
    try:
        return str(psutil.Process(pid).status())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return "gone"
    except psutil.AccessDenied:
        return "unknown"


_CULPRIT_STATES = {
    psutil.STATUS_STOPPED: "its process is stopped (state T, e.g. SIGSTOP or a debugger)",
    psutil.STATUS_TRACING_STOP: "its process is stopped by a tracer (state t)",
    psutil.STATUS_DISK_SLEEP: "its process is stuck in uninterruptible I/O (state D)",
}


def describe_stall(beats: dict[int, dict[str, Any]], idle_s: float, limit_s: float) -> Stall:
    """Name the stalled rank (see the module docstring) and say why the run is ended."""
    tail = f"no rank made progress for {idle_s:.0f} s (train.watchdog_s = {limit_s:g})"
    states = {r: _process_state(b.get("pid")) for r, b in beats.items()}
    for rank in sorted(beats):
        why = _CULPRIT_STATES.get(states[rank])
        if why:
            b = beats[rank]
            return Stall(rank, b.get("pid"), b.get("step"), idle_s,
                         f"rank {rank} (pid {b.get('pid')}) stalled at step {b.get('step')}: "
                         f"{why}; {tail}")  # fmt: skip
    gone = [r for r in sorted(beats) if states[r] == "gone"]
    if gone:
        b = beats[gone[0]]
        return Stall(gone[0], b.get("pid"), b.get("step"), idle_s,
                     f"rank {gone[0]} (pid {b.get('pid')}) is gone at step {b.get('step')} "
                     f"while the others wait; {tail}")  # fmt: skip
    positions = {r: (int(b.get("step", 0)), int(b.get("micro", 0))) for r, b in beats.items()}
    if positions and len(set(positions.values())) > 1:
        rank = min(positions, key=lambda r: positions[r])
        b = beats[rank]
        ahead = max(positions.values())
        return Stall(rank, b.get("pid"), b.get("step"), idle_s,
                     f"rank {rank} (pid {b.get('pid')}) stalled at step {positions[rank][0]} "
                     f"micro-step {positions[rank][1]} while others reached step {ahead[0]} "
                     f"micro-step {ahead[1]}; {tail}")  # fmt: skip
    step = next(iter(positions.values()))[0] if positions else None
    return Stall(None, None, step, idle_s,
                 f"every rank on this node waits in a collective at step {step} (a stalled "
                 f"rank on another node, or a hung collective); {tail}")  # fmt: skip


class Watchdog:
    """Polled by the keeper: returns a `Stall` once no heartbeat changed for ``limit_s``.

    It arms with the first heartbeat of a micro-step (``phase == "train"``): loading the model
    and data has its own bound (the collective timeout of the first collective after it).
    ``limit_s <= 0`` disables it.
    """

    def __init__(self, run_dir: Path, limit_s: float) -> None:
        self.run_dir = Path(run_dir)
        self.limit_s = float(limit_s)
        self.armed = False
        self._signature: tuple[Any, ...] | None = None
        self._changed_at = time.monotonic()

    def check(self, now: float | None = None) -> Stall | None:
        """Look at the heartbeats once; the stall verdict, or None while all is well."""
        if self.limit_s <= 0:
            return None
        now = time.monotonic() if now is None else now
        beats = read_heartbeats(self.run_dir)
        signature = tuple(
            (r, b.get("step"), b.get("micro"), b.get("phase"), b.get("time"))
            for r, b in sorted(beats.items())
        )
        if signature != self._signature:
            self._signature, self._changed_at = signature, now
            self.armed = self.armed or any(b.get("phase") == "train" for b in beats.values())
            return None
        idle = now - self._changed_at
        if not self.armed or idle < self.limit_s:
            return None
        return describe_stall(beats, idle, self.limit_s)
