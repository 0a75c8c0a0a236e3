"""What each rank does for the run's safety: heartbeats, an orphan check, and (tests) faults.

`RankGuard.beat` is called at the start of every micro-step. It writes the rank's heartbeat for
the keeper's watchdog (`homelab_dp.supervise.watchdog`) and tells the worker when its launcher is gone
(the rank was re-parented: the torchrun agent died), so that the rank stops gracefully instead
of running on as an orphan.

Long work keeps the heartbeats flowing (the phases: `homelab_dp.runs.folder.heartbeats`):

- `RankGuard.beating` (a checkpoint, on every rank): a thread beats every `BEAT_EVERY_S` while
  the block runs, so a checkpoint write longer than ``train.watchdog_s`` is not a stall; a rank
  that is stopped or killed stops beating and is.
- `RankGuard.on_rank0` (the result, an adapter merge): rank 0 does the work in a thread while
  every rank's main thread meets in a tiny all-reduce each second ("done yet?") and beats —
  rank 0 in the work's phase, the others ``waiting``. No collective ever waits longer than a
  second or so for rank 0, whatever the work takes, so ``train.collective_timeout_s`` bounds
  real hangs only, with gloo and NCCL alike and no per-call timeout. A rank 0 that stops (or
  dies) stops beating and leaves its peers in the all-reduce: the watchdog (or the collective
  timeout, or torchrun) ends the run.

Fault injection, for the reliability tests only — never set in normal use::

    HOMELAB_DP_FAULT="KIND:rank=R:step=S"      (several faults separated by ";")

fires once per run folder (a marker in ``logs/`` keeps a resumed or retried run from firing it
again) on global rank R at optimizer step S (1-based, the step being computed):

    sigkill           the rank SIGKILLs itself at the start of a micro-step (mid-step)
    sigstop           the rank SIGSTOPs itself at the start of a micro-step (a hang)
    oom               the micro-step raises torch.OutOfMemoryError (as a too-large batch would)
    kill-after-shard  the rank SIGKILLs itself after writing its checkpoint shard, before the
                      checkpoint's completion marker
    enospc            writing the rank's checkpoint shard fails with OSError(ENOSPC)
    slow-result       writing the result sleeps ``seconds=T`` (default 20) on the rank, inside
                      the work (no beats of its own): a save longer than the watchdog's limit
                      and the collective timeout (``step`` is the run's last step)
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from homelab_dp.planning.batch_shape import BatchShape, out_of_memory_words
from homelab_dp.runs.folder.heartbeats import (
    BEAT_EVERY_S,
    TRAIN,
    WAITING,
    heartbeat_dir,
    write_heartbeat,
)
from homelab_dp.runs.run_spec import Resolved

FAULT_ENV = "HOMELAB_DP_FAULT"
FAULT_KINDS = ("sigkill", "sigstop", "oom", "kill-after-shard", "enospc", "slow-result")
T = TypeVar("T")


def _fault_items(text: str) -> list[tuple[str, dict[str, str]]]:
    """``"oom:rank=1:step=2;slow-result:seconds=9"`` → [("oom", {"rank": "1", "step": "2"}), …]."""
    items = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kind, *fields = item.split(":")
        if kind not in FAULT_KINDS:
            raise ValueError(f"{FAULT_ENV}: unknown fault {kind!r} (known: {FAULT_KINDS})")
        items.append((kind, dict(f.split("=", 1) for f in fields)))
    return items


def _parse_faults(text: str) -> list[tuple[str, int, int]]:
    """``"oom:rank=1:step=2;sigkill:rank=0:step=5"`` → [("oom", 1, 2), ("sigkill", 0, 5)]."""
    return [(kind, int(v.get("rank", 0)), int(v.get("step", 1))) for kind, v in _fault_items(text)]


def fault_armed(kind: str, run_dir: Path, rank: int, step: int) -> bool:
    """True (once per run folder) when the test environment asks for ``kind`` here and now."""
    text = os.environ.get(FAULT_ENV)
    if not text or (kind, rank, step) not in _parse_faults(text):
        return False
    marker = Path(run_dir) / "logs" / f"fault-{kind}-rank{rank}-step{step}"
    try:  # O_EXCL: exactly one firing, even across a resume or an auto-fit retry
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


def fault_seconds(kind: str, default: float) -> float:
    """The ``seconds=T`` of the first fault of ``kind`` in the environment (else ``default``)."""
    for name, values in _fault_items(os.environ.get(FAULT_ENV, "")):
        if name == kind and "seconds" in values:
            return float(values["seconds"])
    return default


def inject_slow_result(run_dir: Path, rank: int, step: int) -> None:
    """The ``slow-result`` fault: sleep inside the result's work, as a very long save would."""
    if os.environ.get(FAULT_ENV) and fault_armed("slow-result", run_dir, rank, step):
        time.sleep(fault_seconds("slow-result", 20.0))


def inject_write_fault(run_dir: Path, rank: int, step: int, after_shard: bool) -> None:
    """Checkpoint writer faults: ENOSPC before the shard, or SIGKILL right after it."""
    if not after_shard and fault_armed("enospc", run_dir, rank, step):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + f" (injected: {FAULT_ENV})")
    if after_shard and fault_armed("kill-after-shard", run_dir, rank, step):
        os.kill(os.getpid(), signal.SIGKILL)


class RankGuard:
    """One rank's heartbeat writer, orphan check and fault-injection point."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.parent = os.getppid()  # the torchrun agent
        folder = heartbeat_dir(self.run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank-{rank}.json"
        self.faults = bool(os.environ.get(FAULT_ENV))
        self._lock = threading.Lock()

    def beat(self, step: int, micro: int = 0, phase: str = TRAIN) -> bool:
        """Record progress; returns True when the rank is orphaned and should stop.

        ``step`` is the optimizer step being computed (1-based), ``micro`` the micro-step.
        """
        beat = {"rank": self.rank, "pid": os.getpid(), "step": step, "micro": micro,
                "phase": phase, "time": time.time()}  # fmt: skip
        with self._lock:  # the main thread and a beating thread never interleave a write
            write_heartbeat(self.path, beat)
        if self.faults and phase == TRAIN:
            self._inject(step)
        return os.getppid() != self.parent

    @contextlib.contextmanager
    def beating(self, step: int, phase: str, every_s: float = BEAT_EVERY_S) -> Iterator[None]:
        """Beat ``phase`` now and every ``every_s`` seconds from a thread while the block runs."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(every_s):
                self.beat(step, phase=phase)

        self.beat(step, phase=phase)
        thread = threading.Thread(target=loop, name=f"homelab-dp-beat-{phase}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def on_rank0(
        self,
        work: Callable[[Callable[[str], None]], T],
        *,
        step: int,
        phase: str,
        device: Any,
        every_s: float = BEAT_EVERY_S,
    ) -> T | None:
        """Run ``work`` on rank 0 while every rank waits without a long collective.

        A collective: every rank calls it. ``work(set_phase)`` runs in a thread on rank 0 and
        may name the phase it is in (``set_phase("merging")``); its value is returned there
        (None elsewhere), and its exception raised there. Every rank's main thread beats and
        meets the others in a one-number all-reduce every ``every_s`` seconds until rank 0's
        work is done: rank 0 beats the work's phase, the others ``waiting``.
        """
        import torch
        import torch.distributed as dist

        current = [phase]
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def set_phase(name: str) -> None:
            current[0] = name

        def target() -> None:
            try:
                outcome["value"] = work(set_phase)
            except BaseException as exc:  # raised again in the main thread below
                outcome["error"] = exc
            finally:
                done.set()

        rank0 = dist.get_rank() == 0
        if rank0:
            threading.Thread(target=target, name=f"homelab-dp-{phase}", daemon=True).start()
        while True:
            if rank0:
                done.wait(every_s)
                self.beat(step, phase=current[0])
            else:
                self.beat(step, phase=WAITING)
            flag = torch.tensor([1.0 if rank0 and done.is_set() else 0.0], device=device)
            dist.all_reduce(flag)  # every rank is in this loop: it waits a second at most
            if flag.item() > 0:
                break
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")

    def _inject(self, step: int) -> None:
        if fault_armed("sigkill", self.run_dir, self.rank, step):
            os.kill(os.getpid(), signal.SIGKILL)
        if fault_armed("sigstop", self.run_dir, self.rank, step):
            os.kill(os.getpid(), signal.SIGSTOP)
        if fault_armed("oom", self.run_dir, self.rank, step):
            import torch

            raise torch.OutOfMemoryError(
                f"out of memory: tried to allocate the activations of step {step} "
                f"(injected: {FAULT_ENV})"
            )


def oom_advice(resolved: Resolved, exc: BaseException) -> tuple[str, str, dict[str, Any] | None]:
    """(message, hint, proposal) of the error event of a rank that ran out of memory: the
    failed batch in words, and planning's fallback (`homelab_dp.planning.batch_shape`) for the
    person reading it. The keeper of a ``run --auto-fit`` asks planning itself."""
    batch = BatchShape.of(resolved.micro_batch, resolved.world_size, resolved.grad_accum,
                          resolved.sequence_parallel)  # fmt: skip
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    message, hint, fallback = out_of_memory_words(
        batch, resolved.world_size, resolved.activation_checkpointing, first
    )
    return message, hint, None if fallback is None else fallback.proposal()
