"""The keeper's watchdog: per-rank heartbeats, and the verdict when a run stops making progress.

Every rank writes ``logs/heartbeats/rank-R.json`` — ``{rank, pid, step, micro, phase, time}`` —
when it starts a micro-step, and every second or so while it is in a long phase (a checkpoint,
saving the result, merging an adapter) or waits for another rank's (`homelab_dp.train.loop.rank_guard`;
the phases: `homelab_dp.runs.folder.heartbeats`). The keeper polls them and judges each rank:

- a rank in ``train`` makes progress when it starts another micro-step;
- a rank in a long phase makes progress with every beat: it beats on a timer while the work
  goes on, so a merge that takes ten minutes is not a stall, and a rank that stops beating
  (stopped, killed, its interpreter stuck) is;
- a rank ``waiting`` for another rank's long phase is never the stalled one.

When a rank that is not waiting has made no progress for ``train.watchdog_s`` seconds the run is
stalled — a rank stopped (SIGSTOP, a debugger), stuck in I/O, or waiting forever in a
collective — and the keeper ends it rather than letting it hang.

Which rank stalled: in a data-parallel step every rank waits for the slowest at the next
collective, so the heartbeats alone often agree. The process states tell the rest: a rank in
state T (stopped) or D (uninterruptible I/O, held for a quarter second) is the culprit;
otherwise the rank whose heartbeat is behind the others'; otherwise every local rank is waiting
in a collective (for a rank on another node, or a collective that never completes).

Stdlib and psutil only: the keeper imports no torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from homelab_dp.runs.folder.heartbeats import LONG_PHASES, TRAIN, WAITING, read_heartbeats


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


def _settled_state(pid: int | None, samples: int = 6, gap_s: float = 0.05) -> str:
    """The process state, with a D (disk-sleep) reading confirmed over ``samples`` readings.

    A healthy process passes through D for milliseconds at a time (paging in, a write that
    reaches the disk), so one D reading says nothing; a rank stuck in I/O stays in D.
    """
    state = _process_state(pid)
    for _ in range(samples - 1):
        if state != psutil.STATUS_DISK_SLEEP:
            break
        time.sleep(gap_s)
        state = _process_state(pid)
    return state


_CULPRIT_STATES = {
    psutil.STATUS_STOPPED: "its process is stopped (state T, e.g. SIGSTOP or a debugger)",
    psutil.STATUS_TRACING_STOP: "its process is stopped by a tracer (state t)",
    psutil.STATUS_DISK_SLEEP: "its process is stuck in uninterruptible I/O (state D)",
}


def _where(beat: dict[str, Any]) -> str:
    """Where a rank was: at step 3, or in its saving-result phase after step 8."""
    phase = beat.get("phase", TRAIN)
    if phase == TRAIN:
        return f"at step {beat.get('step')}"
    return f"in its {phase} phase after step {beat.get('step')}"


def describe_stall(
    beats: dict[int, dict[str, Any]],
    idle_s: float,
    limit_s: float,
    idle_ranks: set[int] | None = None,
) -> Stall:
    """Name the stalled rank (see the module docstring) and say why the run is ended.

    ``idle_ranks``: the ranks that made no progress (default: every rank). When others still
    make progress (beat in a long phase), the culprit is among the idle ones.
    """
    pool = beats if idle_ranks is None else {r: beats[r] for r in idle_ranks if r in beats}
    candidates = sorted(pool)
    busy = sorted(r for r in beats if r not in pool and beats[r].get("phase") != WAITING)
    limit = f"{idle_s:.0f} s (train.watchdog_s = {limit_s:g})"
    tail = f"no rank made progress for {limit}"
    if busy:  # others still beat in a long phase: only the silent ones made no progress
        tail = f"no progress on rank {', '.join(map(str, candidates))} for {limit}"
    states = {r: _settled_state(beats[r].get("pid")) for r in candidates}
    for rank in candidates:
        why = _CULPRIT_STATES.get(states[rank])
        if why:
            b = beats[rank]
            return Stall(rank, b.get("pid"), b.get("step"), idle_s,
                         f"rank {rank} (pid {b.get('pid')}) stalled {_where(b)}: "
                         f"{why}; {tail}")  # fmt: skip
    gone = [r for r in candidates if states[r] == "gone"]
    if gone:
        b = beats[gone[0]]
        return Stall(gone[0], b.get("pid"), b.get("step"), idle_s,
                     f"rank {gone[0]} (pid {b.get('pid')}) is gone {_where(b)} "
                     f"while the others wait; {tail}")  # fmt: skip
    if candidates and busy:  # some ranks still beat in a long phase: the silent one stalled
        rank, b = candidates[0], beats[candidates[0]]
        return Stall(rank, b.get("pid"), b.get("step"), idle_s,
                     f"rank {rank} (pid {b.get('pid')}) stopped beating {_where(b)} while "
                     f"rank {', '.join(map(str, busy))} still beat; {tail}")  # fmt: skip
    positions = {r: (int(b.get("step", 0)), int(b.get("micro", 0))) for r, b in pool.items()}
    if positions and len(set(positions.values())) > 1:
        rank = min(positions, key=lambda r: positions[r])
        b = beats[rank]
        ahead = max(positions.values())
        return Stall(rank, b.get("pid"), b.get("step"), idle_s,
                     f"rank {rank} (pid {b.get('pid')}) stalled at step {positions[rank][0]} "
                     f"micro-step {positions[rank][1]} while others reached step {ahead[0]} "
                     f"micro-step {ahead[1]}; {tail}")  # fmt: skip
    if len(pool) == 1 and (pool[candidates[0]].get("phase", TRAIN) != TRAIN or len(beats) > 1):
        rank, b = candidates[0], pool[candidates[0]]  # the one rank the others wait for is silent
        return Stall(rank, b.get("pid"), b.get("step"), idle_s,
                     f"rank {rank} (pid {b.get('pid')}) stopped beating {_where(b)}"
                     f"{' while the others wait for it' if len(beats) > 1 else ''}; "
                     f"{tail}")  # fmt: skip
    step = next(iter(positions.values()))[0] if positions else None
    return Stall(None, None, step, idle_s,
                 f"every rank on this node waits in a collective at step {step} (a stalled "
                 f"rank on another node, or a hung collective); {tail}")  # fmt: skip


def progress_key(beat: dict[str, Any]) -> tuple[Any, ...]:
    """What must change for a heartbeat to count as its rank's progress.

    In training a new micro-step or step; in a long phase also every new beat (its time); a
    waiting rank's beats are never progress.
    """
    phase = beat.get("phase", TRAIN)
    key = (beat.get("step"), beat.get("micro"), phase)
    return (*key, beat.get("time")) if phase in LONG_PHASES else key


class Watchdog:
    """Polled by the keeper: returns a `Stall` once a rank made no progress for ``limit_s``.

    It arms with the first heartbeat of a micro-step (``phase == "train"``): loading the model
    and data has its own bound (the collective timeout of the first collective after it).
    ``limit_s <= 0`` disables it. `observe` is the decision on heartbeats already read (tests
    replay recorded ones); `check` reads them from the run folder first.
    """

    def __init__(self, run_dir: Path, limit_s: float) -> None:
        self.run_dir = Path(run_dir)
        self.limit_s = float(limit_s)
        self.armed = False
        self._keys: dict[int, tuple[Any, ...]] = {}
        self._changed_at: dict[int, float] = {}

    def check(self, now: float | None = None) -> Stall | None:
        """Look at the heartbeats once; the stall verdict, or None while all is well."""
        if self.limit_s <= 0:
            return None
        now = time.monotonic() if now is None else now
        return self.observe(read_heartbeats(self.run_dir), now)

    def observe(self, beats: dict[int, dict[str, Any]], now: float) -> Stall | None:
        """Fold one reading of every rank's heartbeat taken at ``now``; a `Stall` or None."""
        if self.limit_s <= 0:
            return None
        for rank, beat in beats.items():
            key = progress_key(beat)
            if self._keys.get(rank) != key:
                self._keys[rank], self._changed_at[rank] = key, now
        self.armed = self.armed or any(b.get("phase") == TRAIN for b in beats.values())
        if not self.armed:
            return None
        judged = [r for r, b in beats.items() if b.get("phase") != WAITING] or list(beats)
        idle = {r for r in judged if now - self._changed_at[r] >= self.limit_s}
        if not idle:
            return None
        idle_s = min(now - self._changed_at[r] for r in idle)
        return describe_stall(beats, idle_s, self.limit_s, idle_ranks=idle)
