"""The queue for the cards: which devices a run uses, and whether a queued run may start.

A run *uses* its devices (its cards by index and UUID, or "the CPU host" for a CPU run) while
its state is starting, running or stopping. A queued run may start when no other run uses any
of its devices, no earlier queued run (first in, first out by creation time) wants one of them,
and — for a GPU run — every card of its plan has the plan's per-card memory free. `waiting`
is the pure rule; `others` and `free_memory` gather its inputs from the run folders and NVML.
The keeper polls it (`homelab_dp.supervise.keeper`); `start` refuses with it (`conflicts`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from homelab_dp.errors import HomelabError, RunStateError
from homelab_dp.probe.hardware import mig_on
from homelab_dp.probe.nvml import probe
from homelab_dp.runs.folder.run_folder import append_event, read_run_spec
from homelab_dp.runs.folder.run_index import known_runs
from homelab_dp.runs.folder.run_state import (
    ACTIVE,
    current_state,
    is_run_process,
    update_state,
)
from homelab_dp.runs.run_events import StateEvent
from homelab_dp.runs.run_spec import RunSpec

CPU_HOST = "cpu"
"""The device key of the CPU host (every CPU run uses all of it)."""


@dataclass(frozen=True)
class Devices:
    """What one run uses: its cards (indices and UUIDs), or the CPU host."""

    cpu: bool
    indices: tuple[int, ...] = ()
    uuids: tuple[str, ...] = ()

    def overlaps(self, other: Devices) -> bool:
        """Whether the two share a device (by UUID when both know them, else by index)."""
        if self.cpu or other.cpu:
            return self.cpu and other.cpu
        if self.uuids and other.uuids:
            return bool(set(self.uuids) & set(other.uuids))
        return bool(set(self.indices) & set(other.indices))

    def shared(self, other: Devices) -> str:
        """The devices both use, in words: "GPU 0, 1" or "the CPU host"."""
        if self.cpu:
            return "the CPU host"
        if self.uuids and other.uuids:
            common = [i for i, u in zip(self.indices, self.uuids, strict=False) if u in other.uuids]
        else:
            common = [i for i in self.indices if i in other.indices]
        return "GPU " + ", ".join(str(i) for i in common or self.indices)


def devices_of(spec: RunSpec) -> Devices:
    """The devices a run spec launches on."""
    return devices_on(spec.resolved.device, spec.launch.gpu_indices, spec.launch.gpu_uuids)


def devices_on(kind: str, indices: Sequence[int], uuids: Sequence[str | None]) -> Devices:
    """The devices of a plan's hardware: "cpu" (the CPU host), or these cards."""
    if kind == "cpu":
        return Devices(cpu=True)
    return Devices(False, tuple(indices), tuple(u for u in uuids if u))


@dataclass(frozen=True)
class Other:
    """Another run as the queue sees it."""

    run_id: str
    status: str
    created: float
    devices: Devices


@dataclass(frozen=True)
class Waiting:
    """Why a queued run waits: its place in the queue and what it waits for (empty: it may start)."""

    position: int
    """1 for the first queued run on its devices."""
    waiting_for: tuple[str, ...]
    """Run ids (running ones first, then earlier queued ones) and "memory on GPU N"."""

    def to_json(self) -> dict[str, Any]:
        """The ``queue`` object of `status --json`."""
        return {"position": self.position, "waiting_for": list(self.waiting_for)}


def waiting(
    run_id: str,
    created: float,
    devices: Devices,
    others: Iterable[Other],
    free: dict[int, int | None] | None = None,
    need_bytes: int | None = None,
) -> Waiting:
    """The queue's rule for one queued run (pure): who is in its way, and its position.

    ``free``: free bytes per card index (None: not probed, a CPU run); ``need_bytes``: the plan's
    per-card estimate. A card whose free memory is unknown does not hold the run back.
    """
    mine = (created, run_id)
    users, ahead = [], []
    for o in others:
        if o.run_id == run_id or not devices.overlaps(o.devices):
            continue
        if o.status in ACTIVE:
            users.append(o.run_id)
        elif o.status == "queued" and (o.created, o.run_id) < mine:
            ahead.append(o)
    ahead.sort(key=lambda o: (o.created, o.run_id))
    blocked = users + [o.run_id for o in ahead]
    if not blocked and free is not None and need_bytes and not devices.cpu:
        blocked += [f"memory on GPU {i}" for i in devices.indices
                    if free.get(i) is not None and free[i] < need_bytes]  # type: ignore[operator]  # fmt: skip
    return Waiting(position=len(ahead) + 1, waiting_for=tuple(blocked))


def conflicts(devices: Devices, others: Iterable[Other]) -> list[Other]:
    """The runs now using any of these devices (a start without --queue is refused over them)."""
    return [o for o in others if o.status in ACTIVE and devices.overlaps(o.devices)]


def run_dirs(root: Path) -> list[Path]:
    """Every run folder the queue considers: every run this user has, wherever its folder is
    (the per-user index, `homelab_dp.runs.folder.run_index`), and those under ``root``."""
    return [r.path for r in known_runs(root) if r.exists]


def others(root: Path, exclude: str | None = None) -> list[Other]:
    """Every other run of this user with its current status (dead keepers corrected)."""
    out = []
    for run_dir in run_dirs(root):
        if run_dir.name == exclude:
            continue
        state = current_state(run_dir)
        status = str(state.get("status") or "unknown")
        if status not in ACTIVE and status != "queued":
            continue  # ended runs use nothing; reading their spec would only cost time
        try:
            spec = read_run_spec(run_dir)
        except (OSError, ValueError, KeyError, HomelabError):  # a damaged run uses nothing known
            continue
        try:
            created = float(state.get("created") or run_dir.stat().st_mtime)
        except (OSError, TypeError, ValueError):
            created = 0.0
        out.append(Other(run_dir.name, status, created, devices_of(spec)))
    return out


def free_memory(indices: Sequence[int], uuids: Sequence[str] = ()) -> dict[int, int | None]:
    """Free bytes on each of these cards now (NVML; None for a card it cannot read).

    On a card with MIG on, a run holds one slice (named among ``uuids`` by its MIG UUID), and
    what is free is that slice's memory, not the whole card's (None when no slice of the run's
    is on it)."""

    try:
        report = probe()
    except HomelabError:  # an unreadable recording: memory unknown, the runs alone decide
        return dict.fromkeys(indices)
    by_index: dict[int, int | None] = {}
    for g in report.gpus:
        by_index[g.index] = g.memory_free
        if mig_on(g) and g.mig is not None:
            ours = [sl.memory_free for sl in g.mig.slices if sl.uuid and sl.uuid in uuids]
            by_index[g.index] = ours[0] if ours else None
    return {i: by_index.get(i) for i in indices}


def queue_state(run_dir: Path) -> Waiting:
    """Where a queued run stands now (for `status` and `runs`; no memory probe)."""
    spec = read_run_spec(run_dir)
    state = current_state(run_dir)
    created = float(state.get("created") or 0.0)
    return waiting(run_dir.name, created, devices_of(spec), others(run_dir.parent, run_dir.name))


def queue_doc(run_dir: Path, state: dict[str, Any]) -> dict[str, Any] | None:
    """A queued run's place: {"position": n, "waiting_for": [run ids, "memory on GPU 1"]}.

    The runs in its way are read now; memory is what its keeper last saw (only it probes)."""
    if state.get("status") != "queued":
        return None
    doc = queue_state(run_dir).to_json()
    if not doc["waiting_for"]:
        kept = (state.get("queue") or {}).get("waiting_for") or []
        doc["waiting_for"] = [w for w in kept if str(w).startswith("memory on")]
    return doc


def check_devices_free(devices: Devices, root: Path) -> None:
    """Refuse a start on devices another run is using (exit 2), naming the run."""
    busy = conflicts(devices, others(root))
    if not busy:
        return
    first = busy[0]
    what = devices.shared(first.devices)
    verb = "is" if devices.cpu else "are"
    more = f" and {len(busy) - 1} more" if len(busy) > 1 else ""
    raise HomelabError(
        f"{what} {verb} in use by run {first.run_id} ({first.status}){more}",
        hint="add --queue to start it when they are free, or --force to start it anyway",
    )


STOPPED_QUEUED = "stopped while queued; nothing was started"
"""The reason of a run stopped before its turn came."""


def leave_queue(run_dir: Path, state: dict[str, Any], timeout: float) -> dict[str, Any] | None:
    """Stop a queued run: its keeper leaves the queue (interrupted, nothing started); the final
    state, or None when its turn came first (the run is active: stop it as a run).

    The request is a mark in state.json (``stop_requested``) that the keeper reads at each look
    at the queue, not a signal: a keeper that has just been spawned (``run --queue --detach``
    returns at once) may not have its handler yet, and a signal would kill it with the run left
    queued for ever. A keeper that is gone all the same (killed) leaves the run to this side:
    it is ended here as the keeper would have ended it."""
    keeper = (state.get("pids") or {}).get("keeper")
    update_state(run_dir, stop_requested=time.time())
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = current_state(run_dir)
        if state.get("status") in ACTIVE:
            return None
        alive = bool(keeper) and is_run_process(state, int(keeper), run_dir)
        if state.get("status") != "queued" and not alive:
            return state
        if state.get("status") == "queued" and not alive:
            append_event(run_dir, StateEvent(status="interrupted", reason=STOPPED_QUEUED))
            return update_state(run_dir, status="interrupted", reason=STOPPED_QUEUED,
                                ended=time.time(), queue=None, queued_only=True)  # fmt: skip
        if state.get("status") == "queued" and not state.get("stop_requested"):
            update_state(run_dir, stop_requested=time.time())  # lost to the keeper's own write
        time.sleep(0.2)
    raise RunStateError(
        f"run {run_dir.name}: still queued {timeout:.0f} s after the stop request",
        hint=f"its keeper (pid {keeper}) did not answer; see {run_dir / 'logs' / 'keeper.log'}",
    )
