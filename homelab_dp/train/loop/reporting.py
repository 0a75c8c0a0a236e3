"""Rank 0's curves where users look: TensorBoard event files in the run folder, W&B, MLflow.

``[log] report_to`` names the loggers (default ``["tensorboard"]``; ``[]`` for none). They are
fed from rank 0's event stream: `train.loop.event_log.EventLog` hands each event it writes to
`Reporting.event`, so the curves hold exactly the figures of ``events.jsonl``:

- a ``step`` event: ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``,
  ``train/samples_per_s``, ``train/step_time_s``, ``train/epoch``, ``train/mfu`` (on a known
  GPU), ``train/comm_seconds`` and ``train/compute_seconds`` (more than one process),
  ``train/rewards_chosen``, ``train/rewards_rejected``, ``train/reward_margin``,
  ``train/reward_accuracy`` (DPO/KTO), ``train/nll``, ``train/log_odds_ratio`` (ORPO),
  ``rank{r}/peak_memory_bytes`` per rank, and the device monitor's newest sample since the
  last logged step (``devices.jsonl``, `supervise.device_monitor`): ``gpu{i}/memory_used_bytes``,
  ``gpu{i}/utilization_pct``, ``gpu{i}/memory_utilization_pct``, ``gpu{i}/temperature_c``,
  ``gpu{i}/power_w`` (on the CPU ``rank{r}/memory_used_bytes`` and ``rank{r}/utilization_pct``,
  the rank's RSS and CPU %), at the first logged step the newest sample taken while loading;
- an ``eval`` event: ``eval/loss``, ``eval/perplexity``, and the objective's figures as in a
  step (``eval/reward_accuracy``…; then a flush);
- ``sample`` events (answers while training, `train.loop.sample_answers`): gathered until the
  step's last, then one table at that step: TensorBoard text ``samples`` (a Markdown table: prompt, answer,
  tokens, seconds), a W&B table ``samples`` (every row so far: W&B tables are immutable),
  an MLflow text artifact ``samples/step-NNNNNN.md``;
- ``end``: flush and close; ``error``: flush.

TensorBoard writes ``RUN/tensorboard/`` (`torch.utils.tensorboard.SummaryWriter`, flushed every
10 s). A resumed run adds a file to the same folder with ``purge_step`` = its first step, so
TensorBoard hides what the interrupted attempt logged after its checkpoint and the curves go on.

W&B (``wandb.init(project, name=id=run id, resume="allow", config, dir=RUN)``) and MLflow
(``set_experiment``, ``start_run(run_name=run id)``, ``log_params``, ``log_metrics(step=)``;
``RUN/mlruns`` unless ``MLFLOW_TRACKING_URI`` is set) are thin wrappers over their public APIs,
untested here (neither is a dependency). The front end refuses a preset that names one that is
not installed (`app.runs.check_reporters`).

A logger never stops training: an error while opening or writing one becomes one ``warning``
event and that logger is dropped for the rest of the run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from homelab_dp import json_safe
from homelab_dp.runs.folder.jsonl_tail import JsonlTail, file_size
from homelab_dp.runs.run_events import (
    GRPO_FIGURES,
    OBJECTIVE_FIGURES,
    EndEvent,
    ErrorEvent,
    EvalEvent,
    Event,
    SampleEvent,
    StepEvent,
    WarningEvent,
)
from homelab_dp.runs.run_spec import RunSpec

TENSORBOARD_DIR = "tensorboard"
"""The event files' folder inside the run folder."""
DEFAULT_PROJECT = "homelab-dp"
"""The W&B project / MLflow experiment when ``log.project`` is empty."""
FLUSH_SECS = 10
"""How stale a live TensorBoard may be (SummaryWriter's default is 120 s)."""
FRESH_S = 5.0
"""A device sample taken this long before the loggers opened still counts (the monitor samples
every second); older ones belong to an earlier attempt."""
_DEVICE_FIELDS = (
    ("memory_used", "memory_used_bytes"),
    ("utilization_pct", "utilization_pct"),
    ("memory_utilization_pct", "memory_utilization_pct"),
    ("temperature_c", "temperature_c"),
    ("power_w", "power_w"),
)
"""A devices.jsonl sample's field → its scalar's name under the device's key."""


class Backend(Protocol):
    """One logger: scalars at a step, flush, close."""

    name: str

    def scalars(self, step: int, values: dict[str, float]) -> None: ...
    def samples(self, step: int, rows: list[SampleEvent]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class TensorBoardBackend:
    """Event files in ``folder`` (a resumed run appends a file; ``purge_step`` hides the
    orphaned tail of the interrupted attempt)."""

    name = "tensorboard"

    def __init__(self, folder: Path, start_step: int, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder), purge_step=start_step + 1, flush_secs=FLUSH_SECS)
        if start_step == 0:  # the preset once, as the TEXT tab shows it
            text = json_safe.dumps(config, indent=2, default=str)
            self.writer.add_text("run/preset", f"```\n{text}\n```", 0)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def samples(self, step: int, rows: list[SampleEvent]) -> None:
        self.writer.add_text("samples", samples_markdown(rows), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    """Weights & Biases: one W&B run per homelab-dp run (a resume continues it)."""

    name = "wandb"

    def __init__(self, run_id: str, project: str, config: dict[str, Any], run_dir: Path) -> None:
        import wandb

        self.run = wandb.init(
            project=project, name=run_id, id=run_id, resume="allow", config=config, dir=str(run_dir)
        )
        self.rows: list[list[Any]] = []
        """Every sample so far: a W&B table cannot grow once logged, so each log has them all."""

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def samples(self, step: int, rows: list[SampleEvent]) -> None:
        import wandb

        self.rows += [[e.step, e.prompt, e.text, e.tokens, e.seconds] for e in rows]
        table = wandb.Table(columns=["step", "prompt", "text", "tokens", "seconds"],
                            data=[list(r) for r in self.rows])  # fmt: skip
        self.run.log({"samples": table}, step=step)

    def flush(self) -> None:
        pass  # wandb sends in the background

    def close(self) -> None:
        self.run.finish()


class MlflowBackend:
    """MLflow: one MLflow run per attempt, named by the run id, the preset as its params."""

    name = "mlflow"

    def __init__(self, run_id: str, project: str, config: dict[str, Any], run_dir: Path) -> None:
        import mlflow

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):  # not ./mlruns of the worker's folder
            mlflow.set_tracking_uri((run_dir / "mlruns").as_uri())
        mlflow.set_experiment(project)
        mlflow.start_run(run_name=run_id)
        mlflow.log_params(flat_params(config))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics(values, step=step)

    def samples(self, step: int, rows: list[SampleEvent]) -> None:
        self.mlflow.log_text(samples_markdown(rows), f"samples/step-{step:06d}.md")

    def flush(self) -> None:
        pass  # every call is sent at once

    def close(self) -> None:
        self.mlflow.end_run()


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested preset tables as dotted keys with string values (MLflow params are flat)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{name}."))
        else:
            out[name] = str(value)[:500]  # MLflow's oldest limit on a value's length
    return out


def step_scalars(event: StepEvent) -> dict[str, float]:
    """The figures of a step event, by tag (None fields left out)."""
    named = {
        "train/loss": event.loss, "train/lr": event.lr, "train/grad_norm": event.grad_norm,
        "train/tokens_per_s": event.tokens_per_s, "train/samples_per_s": event.samples_per_s,
        "train/step_time_s": event.step_time_s, "train/epoch": event.epoch,
        "train/mfu": event.mfu, "train/comm_seconds": event.comm_seconds,
        "train/compute_seconds": event.compute_seconds,
        **{f"train/{name}": getattr(event, name) for name in OBJECTIVE_FIGURES},
        **{f"train/{name}": getattr(event, name) for name in GRPO_FIGURES},
        **{f"train/reward_{name}": v for name, v in event.reward_functions.items()},
    }  # fmt: skip
    out = {tag: float(v) for tag, v in named.items() if v is not None}
    for rank, peak in enumerate(event.peak_memory_bytes):
        out[f"rank{rank}/peak_memory_bytes"] = float(peak)
    return out


def eval_scalars(event: EvalEvent) -> dict[str, float]:
    """The figures of an eval event, by tag."""
    named = {"eval/loss": event.loss, "eval/perplexity": event.perplexity,
             **{f"eval/{name}": getattr(event, name) for name in OBJECTIVE_FIGURES}}  # fmt: skip
    return {tag: float(v) for tag, v in named.items() if v is not None}


def samples_markdown(rows: list[SampleEvent]) -> str:
    """One step's samples as a Markdown table (TensorBoard's text tab renders it)."""

    def cell(text: str) -> str:  # one table cell: no row or column breaks
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>") or " "

    lines = ["| prompt | answer | tokens | seconds |", "|---|---|---|---|"]
    lines += [f"| {cell(e.prompt)} | {cell(e.text)} | {e.tokens} | {e.seconds:.2f} |" for e in rows]
    return "\n".join(lines)


def device_scalars(sample: dict[str, Any]) -> dict[str, float]:
    """A devices.jsonl sample as scalars: ``{key}/{name}`` per device (``gpu0``, ``rank1``)."""
    out: dict[str, float] = {}
    for device in sample.get("devices") or []:
        key = device.get("key") or f"gpu{device.get('index', 0)}"
        for field, name in _DEVICE_FIELDS:
            value = device.get(field)
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[f"{key}/{name}"] = float(value)
    return out


class DeviceSamples:
    """The monitor's newest sample since the last call (``devices.jsonl``).

    Read from its last 64 KiB when the loggers open (a resume does not reread a long run's
    history; the first step still gets the sample taken while the model loaded), and only
    samples at most `FRESH_S` seconds older than the opening count (not the last attempt's)."""

    def __init__(self, path: Path, now: float | None = None) -> None:
        self.tail = JsonlTail(path, start=max(file_size(path) - 65536, 0))  # a cut line: skipped
        self.since = (time.time() if now is None else now) - FRESH_S

    def newest(self) -> dict[str, float]:
        """Scalars of the newest fresh sample with devices since the last call; {} when none."""
        samples = [s for s in self.tail.read()
                   if s.get("devices") and float(s.get("time") or 0.0) >= self.since]  # fmt: skip
        return device_scalars(samples[-1]) if samples else {}


class Reporting:
    """Rank 0's loggers, fed with events; a logger that fails is dropped with one warning."""

    def __init__(
        self, backends: list[Backend], devices: DeviceSamples | None, warn: Callable[[str], Any]
    ) -> None:
        self.backends = backends
        self.devices = devices
        self.warn = warn
        self.closed = False
        self.pending: list[SampleEvent] = []
        """Sample events of one step not yet logged (logged at the next event of another kind
        or step: a step's samples are written one after the other)."""

    def event(self, event: Event) -> None:
        """Log what ``event`` carries (step, eval), flush (eval, error) or close (end)."""
        if self.closed:
            return
        if self.pending and not (isinstance(event, SampleEvent)
                                 and event.step == self.pending[0].step):  # fmt: skip
            self._samples()
        if isinstance(event, SampleEvent):
            self.pending.append(event)
        elif isinstance(event, StepEvent):
            values = step_scalars(event)
            if self.devices is not None:
                values.update(self.devices.newest())
            self._each("write", lambda b: b.scalars(event.step, values))
        elif isinstance(event, EvalEvent):
            values = eval_scalars(event)
            self._each("write", lambda b: b.scalars(event.step, values))
            self._each("flush", lambda b: b.flush())
        elif isinstance(event, EndEvent):
            self.close()
        elif isinstance(event, ErrorEvent):
            self._each("flush", lambda b: b.flush())

    def close(self) -> None:
        """Flush and close every logger (once; later events are ignored)."""
        if not self.closed:
            if self.pending:
                self._samples()
            self.closed = True
            self._each("close", lambda b: b.close())

    def _samples(self) -> None:
        rows, self.pending = self.pending, []
        self._each("write", lambda b: b.samples(rows[0].step, rows))
        self._each("flush", lambda b: b.flush())

    def _each(self, what: str, action: Callable[[Backend], Any]) -> None:
        for backend in list(self.backends):
            try:
                action(backend)
            except Exception as exc:  # a logger never stops training
                self.backends.remove(backend)
                self.warn(f"{backend.name}: could not {what} ({type(exc).__name__}: {exc}); "
                          "logging to it stopped, training goes on")  # fmt: skip


def open_backend(name: str, spec: RunSpec, run_dir: Path, start_step: int) -> Backend:
    """One logger by its ``log.report_to`` name (raises whatever the logger raises)."""
    config = spec.preset.to_dict()
    project = spec.preset.log.project or DEFAULT_PROJECT
    run_id = spec.run_id or run_dir.name
    if name == "tensorboard":
        return TensorBoardBackend(run_dir / TENSORBOARD_DIR, start_step, config)
    if name == "wandb":
        return WandbBackend(run_id, project, config, run_dir)
    if name == "mlflow":
        return MlflowBackend(run_id, project, config, run_dir)
    raise ValueError(f"unknown logger {name!r}")


def open_reporting(spec: RunSpec, run_dir: Path, start_step: int, events: Any) -> Reporting | None:
    """Rank 0's loggers for ``spec.preset.log.report_to``, or None for ``[]``. ``events`` (an
    `EventLog`) receives a warning for each logger that cannot open; the run goes on."""
    names = list(dict.fromkeys(spec.preset.log.report_to))  # in order, each once

    def warn(message: str) -> None:
        events.write(WarningEvent(message=message))

    backends: list[Backend] = []
    for name in names:
        try:
            backends.append(open_backend(name, spec, run_dir, start_step))
        except Exception as exc:  # not installed after all, not logged in, …
            warn(
                f"{name}: could not start ({type(exc).__name__}: {exc}); the run goes on without it"
            )
    if not names:
        return None
    return Reporting(backends, DeviceSamples(run_dir / "devices.jsonl"), warn)
