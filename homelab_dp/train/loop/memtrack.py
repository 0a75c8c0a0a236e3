"""Peak memory of training steps, per phase: live tensor bytes on the CPU, the caching
allocator's counters on CUDA.

CPU: :class:`LiveTensors` is a ``TorchDispatchMode`` that sees every tensor an operator returns
(including those made inside autograd's backward, DDP's reducer and the optimizer's foreach
kernels) and follows each storage with a weak reference, so a tensor leaves the count the moment
it dies. A storage is counted once, whatever views of it exist. Tensors made before the mode was
entered (weights, gradients, optimizer state) are registered with :meth:`LiveTensors.track`.
``torch.distributed._tools.MemTracker`` works on the CPU as well, but it keeps no per-phase peaks
and walks every tracked module on every operator; this is the part of it we need.

CUDA: ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``, reset at each phase mark.

Phases, in order: ``load`` (model load, wrapping, optimizer construction; measure runs only),
``forward`` (from the previous mark to the end of a micro-step's loss), ``backward``,
``optimizer`` (clipping, the update, zero_grad). A phase that recurs (accumulation, several
steps) keeps its largest peak.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from homelab_dp.runs.run_events import MemoryEvent
from homelab_dp.runs.run_spec import MEASURED_STEPS, RunSpec

PHASES = ("load", "forward", "backward", "optimizer")
CATEGORIES = ("weights", "buffers", "gradients", "optimizer", "other")
"""What a storage holds; "other" is activations, logits, DDP buckets and temporaries."""


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind ``t``: its own, or those inside a wrapper subclass (DTensor)."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        inner = (getattr(t, a) for a in attrs)
        return [st for x in inner if isinstance(x, torch.Tensor) for st in _storages(x)]
    if t.is_meta or isinstance(t, FakeTensor):
        # Sizes without memory: FSDP's sharded load builds the model on meta, and DTensor
        # propagates shardings on fake tensors of the full (global) shape.
        return []
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # e.g. sparse tensors: not counted
        return []


@dataclass
class PhaseMemory:
    """One phase: its peak and what was still alive when it ended."""

    peak: int = 0
    end: int = 0
    reserved_peak: int | None = None
    """CUDA only: the caching allocator's reserved-bytes peak."""
    peak_by_category: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"peak_bytes": self.peak, "end_bytes": self.end}
        if self.reserved_peak is not None:
            out["reserved_peak_bytes"] = self.reserved_peak
        if self.peak_by_category:
            out["peak_by_category"] = dict(self.peak_by_category)
        return out


class LiveTensors(TorchDispatchMode):
    """Bytes of live tensor storages, their peak and the split by category at the peak."""

    def __init__(self) -> None:
        super().__init__()
        self._info: dict[int, tuple[weakref.ref, int, str]] = {}
        self.current = 0
        self.peak = 0
        self.by_category = dict.fromkeys(CATEGORIES, 0)
        self.peak_by_category = dict(self.by_category)
        self._resize: Any = None

    # ---------------------------------------------------------------- bookkeeping
    def _add(self, st: torch.UntypedStorage, category: str) -> None:
        key = id(st)
        known = self._info.get(key)
        nbytes = st.nbytes()
        if known is not None and known[0]() is st:
            if nbytes != known[1]:  # resized in place (FSDP2 frees unsharded storages so)
                self._info[key] = (known[0], nbytes, known[2])
                self._move(known[2], nbytes - known[1])
            return
        ref = weakref.ref(st, lambda _r, k=key: self._forget(k))
        self._info[key] = (ref, nbytes, category)
        self._move(category, nbytes)

    def _forget(self, key: int) -> None:
        known = self._info.pop(key, None)
        if known is not None:
            self._move(known[2], -known[1])

    def _move(self, category: str, delta: int) -> None:
        self.current += delta
        self.by_category[category] += delta
        if self.current > self.peak:
            self.peak = self.current
            self.peak_by_category = dict(self.by_category)

    def track(self, tensors: Iterable[torch.Tensor | None], category: str) -> None:
        """Count ``tensors`` (already tracked or not) under ``category`` from now on."""
        for t in tensors:
            if t is None:
                continue
            for st in _storages(t):
                known = self._info.get(id(st))
                if known is None or known[0]() is not st:
                    self._add(st, category)
                elif known[2] != category:
                    self.by_category[known[2]] -= known[1]
                    self.by_category[category] += known[1]
                    self._info[id(st)] = (known[0], known[1], category)

    def add_constant(self, nbytes: int, category: str) -> None:
        """Bytes held where no operator shows them (e.g. DDP buckets made before tracking)."""
        self._move(category, int(nbytes))

    def reset_peak(self) -> None:
        """Start a new peak window at the current level."""
        self.peak = self.current
        self.peak_by_category = dict(self.by_category)

    # ---------------------------------------------------------------- the mode
    def __enter__(self) -> LiveTensors:
        # UntypedStorage.resize_ is no operator the mode sees; FSDP2 uses it to free and
        # re-allocate unsharded parameters.
        original = torch.UntypedStorage.resize_
        self._resize = original

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = original(st, size)
            known = self._info.get(id(st))
            if known is not None and known[0]() is st:
                self._add(st, known[2])
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        if self._resize is not None:
            torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
            self._resize = None
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    self._add(st, "other")
        return out


def model_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, list[torch.Tensor]]:
    """Weights, buffers, gradients and optimizer state, by category."""
    params = list(model.parameters())
    out = {
        "weights": params,
        "buffers": list(model.buffers()),
        "gradients": [p.grad for p in params if p.grad is not None],
    }
    if optimizer is not None:
        inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps one
        flat, _ = tree_flatten(list(inner.state.values()))
        out["optimizer"] = [t for t in flat if isinstance(t, torch.Tensor)]
    return out


class MemoryProbe:
    """Per-phase peaks of one rank: live tensors on the CPU, allocator counters on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.kind = "cuda_max_allocated" if self.cuda else "live_tensor_bytes"
        self.tracker: LiveTensors | None = None
        self.phases: dict[str, PhaseMemory] = {}
        self.peak_by_category: dict[str, int] = {}
        self.peak = 0
        self.state: Any = None
        """Called at each mark for the model's tensors by category, so that gradients and
        optimizer state made since the last mark are counted as such from then on."""

    def start(self, state: dict[str, list[torch.Tensor]] | None = None, constant: int = 0) -> None:
        """Begin measuring; ``state`` is what exists already, ``constant`` bytes held unseen."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self.tracker = LiveTensors()
        for category, tensors in (state or {}).items():
            self.tracker.track(tensors, category)
        if constant:
            self.tracker.add_constant(constant, "other")
        self.tracker.reset_peak()
        self.tracker.__enter__()

    def track(self, state: dict[str, list[torch.Tensor]]) -> None:
        """(Re)label existing tensors, e.g. the model after loading."""
        if self.tracker is not None:
            for category, tensors in state.items():
                self.tracker.track(tensors, category)

    def mark(self, phase: str) -> None:
        """End the current window: its peak belongs to ``phase``."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            peak = int(torch.cuda.max_memory_allocated(self.device))
            now = PhaseMemory(peak, int(torch.cuda.memory_allocated(self.device)),
                              int(torch.cuda.max_memory_reserved(self.device)))  # fmt: skip
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            t = self.tracker
            if t is None:
                return
            now = PhaseMemory(t.peak, t.current, None, dict(t.peak_by_category))
            if self.state is not None:
                self.track(self.state())
            t.reset_peak()
        old = self.phases.get(phase)
        if old is None or now.peak >= old.peak:  # ties: the later (steady-state) breakdown
            self.phases[phase] = now
        if now.peak > self.peak:
            self.peak = now.peak
            self.peak_by_category = now.peak_by_category

    def stop(self) -> None:
        """Leave the dispatch mode (the counts stay readable)."""
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            self.tracker = None

    @property
    def peak_phase(self) -> str:
        """The phase whose peak is the largest."""
        if not self.phases:
            return ""
        return max(self.phases, key=lambda p: self.phases[p].peak)

    def process_figures(self) -> dict[str, int | None]:
        """What the process holds beyond its tensors' peak, for the overhead calibration.

        CPU: the resident-set peak of the process. CUDA: the caching allocator's reserved peak,
        and the device memory in use beyond what it reserved (context, NCCL; other processes
        on the same card count too).
        """
        if not self.cuda:
            import resource

            rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
            return {"process_peak_bytes": rss_peak, "runtime_bytes": None}
        reserved = [p.reserved_peak or 0 for p in self.phases.values()]
        free, total = torch.cuda.mem_get_info(self.device)
        runtime = total - free - int(torch.cuda.memory_reserved(self.device))
        return {"process_peak_bytes": max(reserved, default=0), "runtime_bytes": runtime}

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "peak_bytes": self.peak,
            "peak_phase": self.peak_phase,
            "peak_by_category": dict(self.peak_by_category),
            "phases": {p: self.phases[p].to_json() for p in PHASES if p in self.phases},
            **self.process_figures(),
        }


def ddp_bucket_bytes(strategy: Any) -> int:
    """Bytes of DDP's gradient buckets that no parameter's ``.grad`` shows, held in C++.

    The reducer allocates them when the model is wrapped, so a probe started later cannot see
    them; with ``gradient_as_bucket_view`` the gradients are views of them and counted as such
    once they exist (`Strategy.unseen_bucket_bytes`).
    """
    return int(strategy.unseen_bucket_bytes())


class WorkerMemory:
    """The worker's memory hook: a measure run, or one probed step of a normal run.

    Measure run (``RunSpec.measure_steps`` N): the probe starts before the model is loaded and
    covers the first `MEASURED_STEPS` steps (every step on CUDA, where it costs nothing): on
    the CPU it sees every tensor operation, which slows a step by a third, so the steps after
    those run untracked and give `measure` an honest speed. Normal run: one steady-state step is probed — the third of this attempt
    (the optimizer state exists from the first, DDP rebuilds its buckets in the second), or the
    last when there are fewer — and every other step runs without any tracking.
    """

    def __init__(self, spec: RunSpec, device: torch.device, total_steps: int) -> None:
        self.measure_steps = spec.measure_steps
        self.device = device
        self.total_steps = total_steps
        self.probe: MemoryProbe | None = None
        self.plan = spec.plan
        self.probe_step: int | None = None
        self.steps: list[int] = []
        self.state: Any = None

    @property
    def measuring(self) -> bool:
        return self.measure_steps > 0

    def before_build(self) -> None:
        if self.measuring:
            self.probe = MemoryProbe(self.device)
            self.probe.start()

    def after_build(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.state = lambda: model_state(model, optimizer)
        if self.measuring and self.probe is not None:
            self.probe.state = self.state
            self.probe.mark("load")

    def begin_step(
        self, step: int, strategy: Any, optimizer: torch.optim.Optimizer
    ) -> MemoryProbe | None:
        """The probe to pass through this step, or None (the normal, untracked case)."""
        if self.measuring:
            cpu_done = self.device.type == "cpu" and len(self.steps) >= MEASURED_STEPS
            if cpu_done and self.probe is not None and self.probe.tracker is not None:
                self.probe.stop()  # the counts stay readable for the report
            return None if cpu_done else self.probe
        if self.probe_step is None:  # the first step of this attempt (resumed runs start later)
            self.probe_step = step + max(0, min(2, self.total_steps - step - 1))
        if step != self.probe_step or self.steps:
            return None
        self.probe = MemoryProbe(self.device)
        self.probe.start(model_state(strategy.inner, optimizer), ddp_bucket_bytes(strategy))
        self.probe.state = self.state
        return self.probe

    def end_step(self, step: int, events: Any) -> None:
        """Close the step's optimizer phase; a normal run reports its probed step now."""
        if self.probe is None:
            return
        if self.measuring and self.device.type == "cpu" and self.probe.tracker is None:
            return  # an untracked step after the measured ones
        self.probe.mark("optimizer")
        self.steps.append(step + 1)
        if self.measuring:
            return
        self.probe.stop()
        self.report(events, mode="run")
        self.probe = None

    def report(self, events: Any, mode: str) -> dict[str, Any] | None:
        """Gather every rank's figures (one collective) and write one ``memory`` event."""
        import torch.distributed as dist

        if self.probe is None:
            return None
        self.probe.stop()
        mine = {"rank": dist.get_rank(), **self.probe.to_json()}
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        per = self.plan.get("per_device_bytes") or {}
        estimate = sum(v for k, v in per.items() if k not in ("overhead", "total")) or None
        measured = max(r["peak_bytes"] for r in ranks)
        return events.write(MemoryEvent(
            mode=mode, kind=self.probe.kind, steps=self.steps, ranks=ranks,
            measured_peak_bytes=measured, estimate_tensor_bytes=estimate,
            estimate_peak_phase=self.plan.get("peak_phase"), estimate=per or None,
            error=(estimate - measured) / measured if estimate and measured else None,
        ))  # fmt: skip
