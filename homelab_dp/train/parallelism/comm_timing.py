"""How long a rank's gradient communication took, and how much of it the step waited on.

Every optimizer step's collectives are timed where they are launched, with no host sync on a
step that is not logged: the records of a step are closed at its end (`CommTimer.end_step`, from
`train.parallelism.strategy.Strategy.zero_grad`) and turned into seconds only when the step log asks
(`CommTimer.read`), by which time the log has synchronised the device anyway.

- **DDP / ZeRO-1** (`ddp_comm_hook`): a comm hook that runs DDP's own default all-reduce
  (``default_hooks.allreduce_hook``: divide by the world size, then sum; the same arithmetic as
  the built-in reducer) and records each bucket's launch and its completion (the future's
  callback, which the reducer waits on). On the CPU (gloo) both are wall clocks; on CUDA they
  are CUDA events on the current stream (the callback of a CUDA future runs with the current
  stream made to wait for the collective), read at the logged step only.
  *comm* is the union of the buckets' launch→completion intervals (buckets queued behind each
  other are not counted twice); *exposed* is what backward finished waiting on: from the last
  bucket's launch (the last gradient ready, the end of backward's compute) to the last
  completion. ZeRO-1's parameter broadcast inside ``optimizer.step`` is not timed.
- **FSDP2** (`TimedAllGather`, `TimedReduceScatter`, set with ``set_custom_all_gather`` /
  ``set_custom_reduce_scatter`` on every ``fully_shard``-ed module): torch's default
  collectives, timed around the call. On the CPU FSDP2 issues them synchronously (gloo has no
  side streams; ``unshard_async_op`` is off), so the call's wall time is both the collective's
  time and the time the rank waited on it: every second is exposed. On CUDA the call only
  enqueues on FSDP2's communication streams, so events on that stream time it; what compute
  could not hide is then taken as the first all-gather of the step (nothing runs before it to
  overlap) and the last reduce-scatter (the optimizer step waits on it) — FSDP2's prefetch
  overlaps the rest. That split is a model applied to measured durations, and untested on a
  card here.

Collectives between optimizer steps (in-run validation, sample generation, a checkpoint: FSDP2
all-gathers them too) are no step's: the loop runs them inside `CommTimer.outside_step`, which
records nothing, so they never land in the next step's record.

``compute_seconds`` of a step event is the step time less the exposed communication (mean over
ranks, `comm_event_fields`).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all_reduce", "all_gather", "reduce_scatter"


@dataclass(frozen=True)
class CommSplit:
    """One rank's communication in one optimizer step."""

    comm_seconds: float
    """Seconds during which at least one of the step's collectives was in flight."""
    exposed_seconds: float
    """Seconds of it the rank waited on (not hidden behind compute)."""
    collectives: int
    """Collectives timed in the step (DDP buckets, FSDP2 gathers and reduce-scatters)."""


NO_COMM = CommSplit(0.0, 0.0, 0)


def union_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def overlapped_split(intervals: Sequence[tuple[float, float]]) -> CommSplit:
    """DDP's split: comm is the union of the buckets' launch→completion intervals; exposed runs
    from the last launch (backward's last gradient) to the last completion."""
    if not intervals:
        return NO_COMM
    last_launch = max(s for s, _ in intervals)
    last_done = max(e for _, e in intervals)
    return CommSplit(union_seconds(intervals), max(last_done - last_launch, 0.0), len(intervals))


def blocking_split(intervals: Sequence[tuple[float, float, str]], on_cuda: bool) -> CommSplit:
    """FSDP2's split. On the CPU every call blocked the rank: all of it is exposed. On CUDA
    (side streams): the step's first all-gather and last reduce-scatter are exposed (FSDP2's
    prefetch overlaps the others)."""
    if not intervals:
        return NO_COMM
    comm = union_seconds([(s, e) for s, e, _ in intervals])
    if not on_cuda:
        return CommSplit(comm, comm, len(intervals))
    gathers = [(s, e) for s, e, kind in intervals if kind == ALL_GATHER]
    scatters = [(s, e) for s, e, kind in intervals if kind == REDUCE_SCATTER]
    exposed = 0.0
    if gathers:
        s, e = min(gathers)
        exposed += e - s
    if scatters:
        s, e = max(scatters, key=lambda iv: iv[1])
        exposed += e - s
    return CommSplit(comm, min(exposed, comm), len(intervals))


class CommTimer:
    """The collectives of this rank's optimizer steps: marks per collective, no host sync.

    ``kind`` is "ddp" (overlapped buckets), "fsdp" (FSDP2's collectives) or "blocking" (the
    all-to-alls of sequence parallelism, every second exposed); on CUDA the marks
    are CUDA events, elsewhere `time.perf_counter` readings. A timer whose ``kind`` is "none"
    (one process: nothing to communicate) reads `NO_COMM`.
    """

    def __init__(self, kind: str, device: torch.device) -> None:
        self.kind = kind
        self.on_cuda = device.type == "cuda"
        self._lock = threading.Lock()  # gloo completes futures on its own threads
        self._open: list[list[Any]] = []
        """This step's collectives so far: ``[start mark, end mark or None, kind]``."""
        self._closed: list[list[Any]] = []
        """The last ended step's collectives (what `read` reports)."""
        self._outside = 0
        """Depth of `outside_step`: collectives launched meanwhile are not the step's."""

    @contextlib.contextmanager
    def outside_step(self) -> Iterator[None]:
        """Collectives launched inside are no optimizer step's (in-run validation, sample
        generation, a checkpoint between steps): not recorded, so FSDP2's all-gathers of an
        evaluation never land in the next step's record."""
        with self._lock:
            self._outside += 1
        try:
            yield
        finally:
            with self._lock:
                self._outside -= 1

    def _mark(self) -> Any:
        if self.on_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()  # on the current stream
            return event
        return time.perf_counter()

    def launch(self, kind: str) -> list[Any]:
        """Mark a collective's launch; pass the record to `complete`."""
        with self._lock:
            outside = self._outside > 0
        if outside:  # not timed: no marks (no CUDA events) either
            return [None, None, kind]
        record = [self._mark(), None, kind]
        with self._lock:
            self._open.append(record)
        return record

    def complete(self, record: list[Any]) -> None:
        """Mark the collective of ``record`` complete."""
        if record[0] is not None:
            record[1] = self._mark()

    def end_step(self) -> None:
        """Close this optimizer step's records (no sync: marks are only moved)."""
        with self._lock:
            self._closed, self._open = self._open, []

    def read(self) -> CommSplit:
        """The last ended step's split. On CUDA this reads the events (call it where the
        device has been synchronised: the step log); a collective never completed counts up
        to its launch only."""
        with self._lock:
            records = [r for r in self._closed if r[1] is not None]
        if not records or self.kind == "none":
            return NO_COMM
        if self.on_cuda:
            origin = records[0][0]
            times = [
                (origin.elapsed_time(s) / 1e3, origin.elapsed_time(e) / 1e3, k)
                for s, e, k in records
            ]
        else:
            times = [(float(s), float(e), k) for s, e, k in records]
        if self.kind == "ddp":
            return overlapped_split([(s, e) for s, e, _ in times])
        if self.kind == "blocking":  # on the compute stream (sequence parallelism's all-to-alls)
            comm = union_seconds([(s, e) for s, e, _ in times])
            return CommSplit(comm, comm, len(times))
        return blocking_split(times, self.on_cuda)


def ddp_comm_hook(timer: CommTimer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce of ``bucket`` (state: the `CommTimer`), its launch and
    completion marked. The reducer waits on the returned future, so the completion mark is
    always taken before backward ends."""
    record = timer.launch(ALL_REDUCE)
    fut = default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        timer.complete(record)
        return f.value()

    return fut.then(done)


class TimedAllGather(DefaultAllGather):
    """FSDP2's default all-gather, marked around the call (see the module's docstring)."""

    def __init__(self, timer: CommTimer) -> None:
        super().__init__()
        self.timer = timer

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:  # fmt: skip
        record = self.timer.launch(ALL_GATHER)
        work = super().__call__(output_tensor, input_tensor, group, async_op)
        self.timer.complete(record)
        return work


class TimedReduceScatter(DefaultReduceScatter):
    """FSDP2's default reduce-scatter, marked around the call (see the module's docstring)."""

    def __init__(self, timer: CommTimer) -> None:
        super().__init__()
        self.timer = timer

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
        op: Any, async_op: bool = False,
    ) -> dist.Work:  # fmt: skip
        record = self.timer.launch(REDUCE_SCATTER)
        work = super().__call__(output_tensor, input_tensor, group, op, async_op)
        self.timer.complete(record)
        return work


def attach_ddp(ddp: torch.nn.parallel.DistributedDataParallel, device: torch.device) -> CommTimer:
    """Time a DDP model's bucket all-reduces (before its first backward)."""
    timer = CommTimer("ddp", device)
    ddp.register_comm_hook(timer, ddp_comm_hook)
    return timer


def attach_fsdp(modules: Sequence[Any], device: torch.device) -> CommTimer:
    """Time FSDP2's all-gathers and reduce-scatters of every ``fully_shard``-ed module."""
    timer = CommTimer("fsdp", device)
    for module in modules:
        module.set_custom_all_gather(TimedAllGather(timer))
        module.set_custom_reduce_scatter(TimedReduceScatter(timer))
    return timer


def comm_event_fields(rows: Sequence[Sequence[float]], world: int) -> dict[str, float | None]:
    """The step event's ``comm_seconds`` and ``compute_seconds`` from `train.loop.rank_stats.RankStats`
    rows (``[*sums, step_time_s, peak, comm_s, exposed_s]``): means over ranks; None for both
    with one process (nothing was communicated, and the step time says the rest)."""
    if world <= 1 or not rows:
        return {"comm_seconds": None, "compute_seconds": None}
    n = len(rows)
    comm = sum(row[-2] for row in rows) / n
    compute = sum(max(row[-4] - row[-1], 0.0) for row in rows) / n
    return {"comm_seconds": comm, "compute_seconds": compute}
