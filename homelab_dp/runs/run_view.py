"""A run's events folded into one live view (pure: used by the CLI follower, the TUI and `status`).

Events are the JSON lines of ``runs/<id>/events.jsonl`` (written by rank 0 and the controller)
and device samples are the lines of ``devices.jsonl`` (written by the monitor). `RunView.apply`
takes either, in order, and keeps what a person watching the run needs; `RunView.apply_state`
folds in ``state.json``, the truth about the run's processes (the one place that does).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections import deque
from collections.abc import Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from homelab_dp.runs.folder.jsonl_tail import read_all
from homelab_dp.runs.folder.run_folder import read_run_spec
from homelab_dp.runs.folder.run_state import current_state
from homelab_dp.runs.model_ref import model_doc
from homelab_dp.runs.run_events import (
    GRPO_FIGURES,
    OBJECTIVE_FIGURES,
    CheckpointEvent,
    DevicesEvent,
    EndEvent,
    ErrorEvent,
    EvalEvent,
    Event,
    MicroEvent,
    SampleEvent,
    StartEvent,
    StateEvent,
    StepEvent,
    StragglerEvent,
    parse_event,
)
from homelab_dp.runs.run_queue import queue_doc

STRAGGLER_RATIO = 1.2
"""A rank is slow when its step time is more than 20% over the median of all ranks."""
STRAGGLER_STEPS = 3
"""…for this many logged steps in a row."""
STEP_FIGURES = (*OBJECTIVE_FIGURES, *GRPO_FIGURES)
"""The objective figures of step events: the preference ones and GRPO's."""
SCALING_STEPS = 5
"""Live scaling is the median over this many logged steps that measured their communication:
one step alone swings with a warm-up, a checkpoint or a busy neighbour."""


class StragglerDetector:
    """Flags ranks whose step time stays over STRAGGLER_RATIO × the median of all ranks.

    Used by rank 0 of the worker (which writes a `straggler` event when a rank is first
    flagged) and by every follower (which shows the warning).
    """

    def __init__(self) -> None:
        self.streak: dict[int, int] = {}
        self.flagged: dict[int, str] = {}
        """rank → warning text."""

    def copy(self) -> StragglerDetector:
        out = StragglerDetector()
        out.streak, out.flagged = dict(self.streak), dict(self.flagged)
        return out

    def update(self, step_times: list[float]) -> list[int]:
        """Feed one logged step's per-rank step times; return the ranks newly flagged."""
        if len(step_times) < 2:
            return []
        median = statistics.median(step_times)
        newly = []
        for rank, t in enumerate(step_times):
            slow = median > 0 and t > STRAGGLER_RATIO * median
            self.streak[rank] = self.streak.get(rank, 0) + 1 if slow else 0
            if self.streak[rank] >= STRAGGLER_STEPS:
                if rank not in self.flagged:
                    newly.append(rank)
                self.flagged[rank] = (
                    f"rank {rank} is {100 * (t / median - 1):.0f}% slower than the median "
                    f"for {self.streak[rank]} steps: every rank waits for it"
                )
            elif not slow:
                self.flagged.pop(rank, None)
        return newly


@dataclass
class DeviceView:
    """The latest sample of one GPU or CPU rank."""

    key: str
    """"gpu0", "gpu1"… or "rank0", "rank1"… on the CPU."""
    utilization_pct: float | None = None
    memory_used: int | None = None
    memory_total: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    energy_wh: float = 0.0
    """Energy used by this device since the run started."""


@dataclass(frozen=True)
class Scaling:
    """How well the processes of a run share its work, measured over its recent logged steps.

    speedup = world × compute_seconds / step_time_s (the step's compute done by every process
    at once, against one process doing it all); efficiency = speedup / world.
    """

    world: int
    """Processes of the run."""
    speedup: float
    """Median over the steps of world × compute / step time: ≈ how many times one process."""
    efficiency: float
    """speedup / world (0..1)."""
    comm_share: float | None
    """Median share of the step the ranks spent in gradient communication (overlapped or not);
    None when the steps measured compute alone."""
    exposed_share: float
    """Median share of the step not spent computing: the communication nothing hid."""
    step_time_s: float
    """Median step time of the same steps."""
    steps: int
    """How many logged steps the medians are over (at most SCALING_STEPS)."""

    def to_json(self) -> dict[str, Any]:
        """``status --json``'s ``scaling``."""
        return dataclasses.asdict(self)


@dataclass
class RunView:
    """Everything a follower shows about one run, updated event by event."""

    run_id: str = ""
    status: str = "starting"
    method: str = ""
    distribution: str = ""
    total_steps: int = 0
    step: int = 0
    epoch: float = 0.0
    loss: float | None = None
    losses: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=2000))
    tokens_per_s_history: deque[tuple[int, float]] = field(
        default_factory=lambda: deque(maxlen=2000)
    )
    evals: deque[EvalEvent] = field(default_factory=lambda: deque(maxlen=2000))
    """The ``eval`` events (validation while training), oldest first; the last is the latest."""
    samples: deque[SampleEvent] = field(default_factory=lambda: deque(maxlen=500))
    """The ``sample`` events (answers while training), oldest first; the last is the latest."""
    sample_seconds: float = 0.0
    """Seconds spent generating samples so far (the ETA counts them for the steps left)."""
    best_eval: EvalEvent | None = None
    """The eval with the lowest loss so far (the first of equals)."""
    lr: float | None = None
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    mfu: float | None = None
    """Model FLOPs utilisation of the latest logged step (0..1); None on the CPU, an unknown GPU
    or events written before the field existed."""
    step_time_s: float | None = None
    micro_batch: int = 0
    grad_accum: int = 1
    micro_step: int = 0
    """Micro-steps done in the current optimizer step (0..grad_accum)."""
    world_size: int = 1
    sequence_parallel: int = 1
    """Ranks every sequence is split over (1: whole sequences), as the start event says."""
    effective_batch: int = 0
    tokens: int = 0
    rank_step_times_s: list[float] = field(default_factory=list)
    peak_memory_bytes: list[int] = field(default_factory=list)
    peak_memory_kind: str = ""
    estimate_bytes: int | None = None
    """The plan's per-device estimate (total), to show beside the measured peak."""
    devices: dict[str, DeviceView] = field(default_factory=dict)
    energy_wh: float = 0.0
    per_kwh: float = 0.0
    currency: str = ""
    started_at: float | None = None
    last_time: float | None = None
    last_checkpoint_step: int | None = None
    end_reason: str | None = None
    error: str | None = None
    final_path: str | None = None
    stragglers: dict[int, str] = field(default_factory=dict)
    """rank → warning text, for ranks slow for STRAGGLER_STEPS logged steps in a row."""
    _detector: StragglerDetector = field(default_factory=lambda: StragglerDetector())
    events_seen: int = 0
    skipped_events: int = 0
    """Event lines of a known type that could not be read (a field of the wrong type): skipped."""
    objective: str = "sft"
    """``train.objective`` as the start event says it (sft, dpo, orpo, kto)."""
    figures: dict[str, deque[tuple[int, float]]] = field(default_factory=dict)
    """Each preference figure a step gave (OBJECTIVE_FIGURES), as (step, value), oldest first;
    a figure no step gave has no entry (an SFT run: none)."""
    timings: deque[tuple[int, float, float, float | None]] = field(
        default_factory=lambda: deque(maxlen=SCALING_STEPS)
    )
    """The latest logged steps that measured their compute: (step, step_time_s,
    compute_seconds, comm_seconds)."""
    predicted: dict[str, Any] | None = None
    """The plan's time model for this run (spec.json's ``plan.predicted``: step_seconds,
    tokens_per_s, speedup_vs_one_device…); None for a run planned before it existed."""

    def copy(self) -> RunView:
        """A copy that shares nothing mutable with this view (cheaper than deepcopy)."""
        out = copy.copy(self)
        out.losses = deque(self.losses, maxlen=self.losses.maxlen)
        out.tokens_per_s_history = deque(
            self.tokens_per_s_history, maxlen=self.tokens_per_s_history.maxlen
        )
        out.evals = deque(self.evals, maxlen=self.evals.maxlen)  # the events are never changed
        out.samples = deque(self.samples, maxlen=self.samples.maxlen)
        out.rank_step_times_s = list(self.rank_step_times_s)
        out.peak_memory_bytes = list(self.peak_memory_bytes)
        out.devices = {k: dataclasses.replace(d) for k, d in self.devices.items()}
        out.stragglers = dict(self.stragglers)
        out._detector = self._detector.copy()
        out.figures = {k: deque(v, maxlen=v.maxlen) for k, v in self.figures.items()}
        out.timings = deque(self.timings, maxlen=self.timings.maxlen)
        out.predicted = dict(self.predicted) if self.predicted is not None else None
        return out

    # ------------------------------------------------------------------ derived figures
    @property
    def eta_s(self) -> float | None:
        """Seconds left at the current step time, plus the samples' share: their seconds so far
        per step done, for each step left (the samples leave the step time out)."""
        if not self.step_time_s or not self.total_steps:
            return None
        per_step = self.step_time_s + (self.sample_seconds / self.step if self.step else 0.0)
        return max(self.total_steps - self.step, 0) * per_step

    @property
    def elapsed_s(self) -> float | None:
        if self.started_at is None or self.last_time is None:
            return None
        return self.last_time - self.started_at

    @property
    def loss_trend(self) -> float | None:
        """Mean loss over the last 10 logged steps minus the 10 before (negative: falling)."""
        values = [v for _, v in self.losses]
        if len(values) < 4:
            return None
        k = min(10, len(values) // 2)
        return statistics.fmean(values[-k:]) - statistics.fmean(values[-2 * k : -k])

    @property
    def last_eval(self) -> EvalEvent | None:
        """The latest evaluation, or None before the first (or without eval data)."""
        return self.evals[-1] if self.evals else None

    def sample_doc(self) -> dict[str, Any] | None:
        """The latest sample as ``status --json``'s ``sample`` (None: none yet): step, prompt,
        text, tokens, seconds."""
        if not self.samples:
            return None
        e = self.samples[-1]
        return {"step": e.step, "prompt": e.prompt, "text": e.text, "tokens": e.tokens,
                "seconds": e.seconds}  # fmt: skip

    def samples_at(self, step: int | None = None) -> list[SampleEvent]:
        """The samples of ``step`` (None: the latest step that has samples), in prompt order."""
        if not self.samples:
            return []
        step = self.samples[-1].step if step is None else step
        return [e for e in self.samples if e.step == step]

    def eval_doc(self) -> dict[str, Any] | None:
        """The latest eval with the best so far, as ``status --json``'s ``eval`` (None: none yet):
        step, loss, perplexity, tokens, best_step, best_loss."""
        last, best = self.last_eval, self.best_eval
        if last is None:
            return None
        doc = {"step": last.step, "loss": last.loss, "perplexity": last.perplexity,
               "tokens": last.tokens, "best_step": best.step if best else None,
               "best_loss": best.loss if best else None}  # fmt: skip
        if last.pairs:  # a preference objective's eval: its pairs and figures
            doc["pairs"] = last.pairs
        doc.update({n: getattr(last, n) for n in OBJECTIVE_FIGURES if getattr(last, n) is not None})
        return doc

    def series(self, name: str) -> list[float]:
        """The values of one preference figure over the logged steps, oldest first."""
        return [v for _, v in self.figures.get(name, ())]

    def objective_doc(self) -> dict[str, float] | None:
        """The latest value of each objective figure a step gave (GRPO's ``reward_<name>``
        included), as ``status --json``'s ``objective_figures`` (None: the run logs none, as
        SFT)."""
        if not self.figures:
            return None
        return {name: series[-1][1] for name, series in self.figures.items() if series}

    @property
    def scaling(self) -> Scaling | None:
        """The measured scaling over the latest logged steps (None with one process, or before
        a step measured its compute)."""
        rows = [(t, c, m) for _, t, c, m in self.timings if t > 0]
        if self.world_size < 2 or not rows:
            return None
        world = self.world_size
        speedup = statistics.median(world * c / t for t, c, _ in rows)
        comm = [m / t for t, _, m in rows if m is not None]
        return Scaling(
            world=world,
            speedup=speedup,
            efficiency=speedup / world,
            comm_share=statistics.median(comm) if comm else None,
            exposed_share=statistics.median(max(t - c, 0.0) / t for t, c, _ in rows),
            step_time_s=statistics.median(t for t, _, _ in rows),
            steps=len(rows),
        )

    @property
    def measured_step_s(self) -> float | None:
        """The median step time of the latest logged steps that measured their compute, else
        the latest step time (one process, older runs)."""
        times = [t for _, t, _, _ in self.timings if t > 0]
        return statistics.median(times) if times else self.step_time_s

    def speed_doc(self) -> dict[str, Any] | None:
        """Predicted against measured, as ``status --json``'s ``speed`` (None: the plan predicted
        nothing): the plan's step seconds, tokens/s, speedup and exposed communication share
        beside the run's."""
        predicted = self.predicted
        if not predicted:
            return None
        scaling = self.scaling
        return {
            "predicted_step_seconds": _number(predicted.get("step_seconds")),
            "measured_step_seconds": self.measured_step_s,
            "predicted_tokens_per_s": _number(predicted.get("tokens_per_s")),
            "measured_tokens_per_s": self.tokens_per_s,
            "predicted_speedup": _number(predicted.get("speedup_vs_one_device")),
            "measured_speedup": scaling.speedup if scaling else None,
            "predicted_exposed_share": _share(predicted),
            "measured_exposed_share": scaling.exposed_share if scaling else None,
        }

    @property
    def tokens_per_wh(self) -> float | None:
        return self.tokens / self.energy_wh if self.energy_wh > 0 else None

    @property
    def cost(self) -> float | None:
        return self.energy_wh / 1000 * self.per_kwh if self.per_kwh else None

    # ------------------------------------------------------------------ folding
    def apply(self, event: dict[str, Any]) -> None:
        """Fold one event or device sample (one JSON line's object) into the view."""
        self.events_seen += 1
        when = event.get("time")
        if isinstance(when, (int, float)):
            self.last_time = float(when)
            if self.started_at is None:
                self.started_at = float(when)
        typed = parse_event(event)
        handler = getattr(self, f"_on_{typed.TYPE}", None) if typed is not None else None
        if handler is not None:
            # A typed event fills in the fields a line lacks; the view keeps its own value
            # for those, so it is told which fields the line gave (with a value).
            given = frozenset(k for k, v in event.items() if v is not None)
            before = dict(self.__dict__)  # shallow: the handlers convert before they append
            try:
                handler(typed, given)
            except (TypeError, ValueError, KeyError, AttributeError, OverflowError):
                # A damaged line (a field of the wrong type): skipped, the view as it was.
                self.__dict__.update(before)
                self.skipped_events += 1

    def apply_state(self, state: dict[str, Any]) -> None:
        """Fold the run's state.json (as `current_state` reads it) into the view.

        state.json is the truth about the processes: a run that crashed writes no event, so
        its status comes from here ("unknown", no readable state.json, tells nothing). A failed
        run's error is the state's reason when it gives one: the keeper names the root cause
        there, where an error event may be a rank's echo of it.
        """
        status = state.get("status")
        if status and status != "unknown":
            self.status = status
        if self.status == "failed":
            self.error = state.get("reason") or self.error

    def _take(self, e: Event, names: tuple[str, ...], given: Set[str]) -> None:
        """Copy the fields the line gave from the typed event."""
        for name in names:
            if name in given:
                setattr(self, name, getattr(e, name))

    def _on_start(self, e: StartEvent, given: Set[str]) -> None:
        self.status = "running"
        self._take(e, ("run_id", "method", "distribution", "total_steps", "world_size",
                       "micro_batch", "grad_accum", "effective_batch", "objective",
                       "sequence_parallel"), given)  # fmt: skip
        # New processes (a resume may even have another world size): scaling measured afresh.
        self.timings = deque(maxlen=SCALING_STEPS)
        if isinstance(e.estimate, dict) and e.estimate.get("total") is not None:  # per device
            self.estimate_bytes = int(e.estimate["total"])
        if "start_step" in given:
            self.step = e.start_step
            # A resume repeats the steps after its checkpoint: their evals are evaluated again.
            kept = [v for v in self.evals if v.step <= e.start_step]
            if len(kept) < len(self.evals):
                self.evals = deque(kept, maxlen=self.evals.maxlen)
                self._find_best()
            answers = [a for a in self.samples if a.step <= e.start_step]  # generated again
            if len(answers) < len(self.samples):
                self.samples = deque(answers, maxlen=self.samples.maxlen)

    def _on_micro(self, e: MicroEvent, given: Set[str]) -> None:
        self.micro_step = int(e.micro_step)
        if "grad_accum" in given:
            self.grad_accum = int(e.grad_accum)

    def _on_step(self, e: StepEvent, given: Set[str]) -> None:
        self.status = "running"
        self.step = int(e.step)
        self.micro_step = 0
        self._take(e, ("total_steps", "epoch", "lr", "tokens_per_s", "samples_per_s",
                       "step_time_s", "micro_batch", "grad_accum", "world_size",
                       "effective_batch", "tokens", "rank_step_times_s", "peak_memory_bytes",
                       "peak_memory_kind"), given)  # fmt: skip
        self.mfu = None if e.mfu is None else float(e.mfu)  # each step says whether it is known
        # Converted before anything is appended: a damaged line leaves the view as it was.
        figures = {n: float(getattr(e, n)) for n in STEP_FIGURES if getattr(e, n) is not None}
        figures.update({f"reward_{n}": float(v) for n, v in e.reward_functions.items()})
        timing = None
        if e.step_time_s is not None and e.compute_seconds is not None:
            comm = None if e.comm_seconds is None else float(e.comm_seconds)
            timing = (self.step, float(e.step_time_s), float(e.compute_seconds), comm)
        for name, value in figures.items():
            self.figures.setdefault(name, deque(maxlen=2000)).append((self.step, value))
        if timing is not None:
            self.timings.append(timing)
        if e.loss is not None:
            self.loss = float(e.loss)
            self.losses.append((self.step, self.loss))
        if e.tokens_per_s is not None:
            self.tokens_per_s_history.append((self.step, float(e.tokens_per_s)))
        self._check_stragglers()

    def _on_eval(self, e: EvalEvent, given: Set[str]) -> None:
        if e.loss is not None:
            self.evals.append(e)
            self._find_best()

    def _on_sample(self, e: SampleEvent, given: Set[str]) -> None:
        # Converted before anything changes: a damaged line leaves the view as it was.
        clean = SampleEvent(
            time=float(e.time),
            step=int(e.step),
            prompt=str(e.prompt),
            text=str(e.text),
            tokens=int(e.tokens),
            seconds=float(e.seconds),
        )
        self.samples.append(clean)
        self.sample_seconds += clean.seconds

    def _find_best(self) -> None:
        self.best_eval = min(self.evals, key=lambda e: float(e.loss or 0.0), default=None)

    def _check_stragglers(self) -> None:
        self._detector.update(self.rank_step_times_s)
        self.stragglers = dict(self._detector.flagged)

    def _on_straggler(self, e: StragglerEvent, given: Set[str]) -> None:
        self.stragglers[int(e.rank)] = str(e.message) if "message" in given else "slow rank"

    def _on_checkpoint(self, e: CheckpointEvent, given: Set[str]) -> None:
        self.last_checkpoint_step = e.step if "step" in given else None

    def _on_end(self, e: EndEvent, given: Set[str]) -> None:
        self.end_reason = e.reason if "reason" in given else None
        done = self.end_reason in ("completed", "early_stopped")  # early_stopped: completed early
        self.status = "completed" if done else "interrupted"
        if e.final_loss is not None:
            self.loss = float(e.final_loss)
        if "final_path" in given:
            self.final_path = e.final_path

    def _on_error(self, e: ErrorEvent, given: Set[str]) -> None:
        self.error = str(e.message) if "message" in given else "error"
        self.status = "failed"

    def _on_state(self, e: StateEvent, given: Set[str]) -> None:
        """Controller events: status changes (starting, running, stopping, failed…)."""
        if e.status:
            self.status = e.status
        if e.reason and self.status == "failed":
            self.error = self.error or e.reason

    def _on_devices(self, e: DevicesEvent, given: Set[str]) -> None:
        """A monitor sample: every device's latest figures and the run's energy so far."""
        for d in e.devices:
            key = str(d.get("key"))
            view = self.devices.setdefault(key, DeviceView(key))
            for name in (
                "utilization_pct", "memory_used", "memory_total", "temperature_c", "power_w",
                "energy_wh",
            ):  # fmt: skip
                if d.get(name) is not None:
                    setattr(view, name, d[name])
        if "energy_wh" in given:
            self.energy_wh = float(e.energy_wh)


def _number(value: Any) -> float | None:
    """A figure of the plan as a float (None: absent, or not a number)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok else None


def _share(predicted: dict[str, Any]) -> float | None:
    """The predicted share of the step that communication leaves exposed."""
    exposed, step = (
        _number(predicted.get("exposed_comm_seconds")),
        _number(predicted.get("step_seconds")),
    )
    return exposed / step if exposed is not None and step else None


def _predicted(plan: dict[str, Any]) -> dict[str, Any] | None:
    """The plan's ``predicted`` block, if it has one (older plans have none)."""
    predicted = plan.get("predicted")
    return dict(predicted) if isinstance(predicted, dict) and predicted else None


def new_view(run_dir: Path) -> RunView:
    """An empty view of the run, with what its run spec says: cost per kWh, estimate, and the
    strategy (a queued run has no start event yet; the worker's repeats it)."""
    spec = read_run_spec(run_dir)
    return RunView(
        run_id=run_dir.name,
        method=spec.resolved.method,
        distribution=spec.resolved.distribution,
        world_size=spec.resolved.world_size,
        sequence_parallel=spec.resolved.sequence_parallel,
        per_kwh=float(spec.preset.cost.per_kwh or 0.0),
        currency=str(spec.preset.cost.currency or ""),
        estimate_bytes=spec.planned_bytes.get("total"),
        objective=spec.preset.train.objective,
        predicted=_predicted(spec.plan),
    )


def view_of(run_dir: Path) -> RunView:
    """Every event and device sample of the run folded into a RunView, with the current status:
    what `status`, `runs`, the followers and the recorded results all read."""
    view = new_view(run_dir)
    for event in read_all(run_dir / "events.jsonl"):
        view.apply(event)
    for sample in read_all(run_dir / "devices.jsonl"):
        view.apply(sample)
    view.apply_state(current_state(run_dir))
    return view


def summarize(run_dir: Path, view: RunView, state: dict[str, Any]) -> dict[str, Any]:
    """One run as a JSON-ready dict (a queued run's ``queue``: position and what it waits for)."""
    started = state.get("created")
    ended = state.get("ended")
    scaling = view.scaling
    duration = (ended or time.time()) - started if started and state.get("status") else None
    return {
        "run_id": run_dir.name,
        "path": str(run_dir),
        "status": state.get("status"),
        "reason": state.get("reason"),
        "created": started,
        "duration_s": duration,
        "model": model_doc(read_run_spec(run_dir)),
        "method": view.method,
        "distribution": view.distribution,
        "world_size": view.world_size,
        "sequence_parallel": view.sequence_parallel,
        "step": view.step,
        "total_steps": view.total_steps,
        "loss": view.loss,
        "tokens": view.tokens,
        "tokens_per_s": view.tokens_per_s,
        "mfu": view.mfu,
        "effective_batch": view.effective_batch,
        "energy_wh": view.energy_wh,
        "tokens_per_wh": view.tokens_per_wh,
        "cost": view.cost,
        "last_checkpoint_step": view.last_checkpoint_step,
        "eval": view.eval_doc(),
        "objective": view.objective,
        "objective_figures": view.objective_doc(),
        "scaling": scaling.to_json() if scaling else None,
        "speed": view.speed_doc(),
        "sample": view.sample_doc(),
        "final_path": view.final_path,
        "peak_memory_bytes": view.peak_memory_bytes,
        "estimate_bytes": view.estimate_bytes,
        "stragglers": [view.stragglers[k] for k in sorted(view.stragglers)],
        "pids": state.get("pids"),
        "exit_code": state.get("exit_code"),
        "attempt": state.get("attempt"),
        "queue": queue_doc(run_dir, state),
    }
