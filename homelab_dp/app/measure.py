"""`homelab-dp measure PRESET`: a few real steps of the planned run, measured rank by rank.

The preset is prepared exactly as `homelab-dp run` prepares it (preflight, plan, data), then run
under torchrun through the launcher from a run folder whose spec.json carries
``"measure_steps": N`` (``train.max_steps = N``, no checkpoints). The worker probes every step
from before the model load (`homelab_dp.train.loop.memtrack`): peak live tensor bytes on the CPU,
``max_memory_allocated`` / ``max_memory_reserved`` on CUDA, per phase (load, forward, backward,
optimizer), and writes one ``memory`` event with every rank's figures. The result is shown beside
the plan's estimate and stored in the calibration file for this hardware, so later plans show the
measured figure and use measured overhead terms (`homelab_dp.planning.memory.memory_calibration`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from homelab_dp.app.plan import hardware_fingerprint
from homelab_dp.errors import HomelabError
from homelab_dp.planning.memory.device_memory import PHASES
from homelab_dp.planning.memory.memory_calibration import CalibrationStore, Measurement
from homelab_dp.planning.planner import plan_objective
from homelab_dp.planning.speed_calibration import record_speed
from homelab_dp.runs.folder.jsonl_tail import json_objects
from homelab_dp.runs.preset_results import steady_speed
from homelab_dp.runs.run_events import MemoryEvent, parse_event
from homelab_dp.runs.run_spec import MEASURED_STEPS

DEFAULT_STEPS = 3
"""Enough for the steady state: the optimizer state exists after step 1, DDP rebuilds its
buckets in step 2."""


@dataclass
class MeasureReport:
    """A measure run: every rank's figures beside the plan's estimate."""

    run_id: str
    run_dir: Path
    fingerprint: str | None
    plan: dict[str, Any]
    memory: dict[str, Any]
    """The worker's ``memory`` event (kind, ranks, measured_peak_bytes, …)."""
    stored: Path | None = None
    objective: dict[str, Any] | None = None
    """What the objective costs in the measured option (`planning.objective_cost`'s JSON block:
    name, resolved reference, sequences per sample, rows of a micro-batch, ...)."""

    @property
    def estimate_tensor_bytes(self) -> int:
        per = self.plan["per_device_bytes"]
        return sum(v for k, v in per.items() if k not in ("overhead", "total"))

    @property
    def measured_tensor_bytes(self) -> int:
        return int(self.memory["measured_peak_bytes"])

    @property
    def error(self) -> float:
        return (self.estimate_tensor_bytes - self.measured_tensor_bytes) / max(
            self.measured_tensor_bytes, 1
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "run_dir": str(self.run_dir),
            "fingerprint": self.fingerprint,
            "kind": self.memory["kind"],
            "steps": self.memory.get("steps"),
            "method": self.plan["method"],
            "distribution": self.plan["distribution"],
            "training": self.plan["training"],
            "estimate": {
                "per_device_bytes": self.plan["per_device_bytes"],
                "tensor_bytes": self.estimate_tensor_bytes,
                "peak_phase": self.plan.get("peak_phase"),
                "phases": self.plan.get("phase_tensor_bytes"),
            },
            "measured_peak_bytes": self.measured_tensor_bytes,
            "error": self.error,
            "ranks": self.memory["ranks"],
            "calibration_file": str(self.stored) if self.stored else None,
            "objective": self.objective,
        }


def measure(
    preset_ref: str,
    *,
    steps: int = DEFAULT_STEPS,
    gpus: str | None = None,
    overrides: list[str] | None = None,
    force: bool = False,
    store: bool = True,
    controller: Any = None,
) -> MeasureReport:
    """Run ``steps`` measured steps of ``preset_ref`` as planned; store the calibration."""
    from homelab_dp.app.runs import make_controller
    from homelab_dp.runs.folder.run_folder import create_run_dir, new_run_id
    from homelab_dp.runs.folder.run_state import update_state
    from homelab_dp.supervise.launcher import run_foreground

    if steps < 1:
        raise HomelabError(f"--steps {steps}: must be at least 1", hint="e.g. --steps 3")
    controller = controller or make_controller()
    # log_every=1: each step's tokens/s is its own, not a mean since step 1
    sets = [*(overrides or []), f"train.max_steps={steps}", "train.checkpoint_every=0",
            "train.log_every=1"]  # fmt: skip
    prepared = controller.prepare(preset_ref, overrides=sets, gpus=gpus, force=force)
    name = Path(prepared.preset.source).stem if prepared.preset.source else "run"
    run_id = new_run_id(f"measure-{name}")
    spec = prepared.run_spec(run_id, measure_steps=steps)
    run_dir = create_run_dir(spec, controller.root)
    update_state(run_dir, status="running", run_id=run_id, created=time.time(), reason="measure")
    rc = run_foreground(run_dir)
    event = _memory_event(run_dir)
    ok = rc == 0 and event is not None
    update_state(run_dir, status="completed" if ok else "failed", ended=time.time(),
                 exit_code=rc, reason="measured" if ok else f"measure run failed (exit {rc})")  # fmt: skip
    if not ok:
        raise HomelabError(
            f"the measure run {run_id} failed (exit code {rc})",
            hint=f"see {run_dir / 'logs'} and `homelab-dp status {run_id}`",
        )
    assert event is not None
    fp = hardware_fingerprint(prepared.planned.hardware, prepared.planned.report)
    planned = prepared.planned
    cost = plan_objective(planned.spec, planned.preset, planned.hardware, prepared.plan.chosen)
    report = MeasureReport(run_id, run_dir, fp, spec.plan, event, objective=cost.to_json())
    if store and fp is not None:
        report.stored = _store(report, prepared)
        _record_speed(run_dir, spec.plan, run_id)
    return report


def _record_speed(run_dir: Path, plan_doc: dict[str, Any], run_id: str) -> Path | None:
    """Record the measure run's speed for the time model
    (`homelab_dp.planning.speed_calibration`): later plans on this machine price compute at it.
    The median of the steps after the tracked ones (`train.loop.memtrack.MEASURED_STEPS`: tracking
    every tensor slows a CPU step by a third), else of the steps after the first: one step
    alone varies by tens of percent on a shared CPU."""
    events = _events(run_dir)
    steps = [int(e.get("step") or 0) for e in events if e.get("type") == "step"]
    untracked = any(s > MEASURED_STEPS for s in steps)
    speed = steady_speed(events, after=MEASURED_STEPS if untracked else 1)
    if speed is None:
        return None
    return record_speed(plan_doc, tokens_per_s=float(speed["tokens_per_s"]), source="measure",
                        run_id=run_id, step_seconds=speed["step_seconds"],
                        compute_seconds=speed["compute_seconds"])  # fmt: skip


def _events(run_dir: Path) -> list[dict[str, Any]]:
    """The run's events that parse as JSON objects."""
    path = run_dir / "events.jsonl"
    return json_objects(path.read_bytes().splitlines()) if path.is_file() else []


def _memory_event(run_dir: Path) -> dict[str, Any] | None:
    """The last ``memory`` event of a measure run."""
    found = None
    for doc in _events(run_dir):
        event = parse_event(doc)
        if isinstance(event, MemoryEvent) and event.mode == "measure":
            found = doc
    return found


def _store(report: MeasureReport, prepared: Any) -> Path:
    """Add the measurement to the calibration file of this hardware."""
    from homelab_dp.planning.planner import measurement_key

    p, planned = prepared.plan, prepared.planned
    ranks = report.memory["ranks"]
    phases = {ph: max(r["phases"].get(ph, {}).get("peak_bytes", 0) for r in ranks)
              for ph in PHASES if any(ph in r["phases"] for r in ranks)}  # fmt: skip
    top = max(ranks, key=lambda r: r["peak_bytes"])
    process = [r.get("process_peak_bytes") for r in ranks if r.get("process_peak_bytes")]
    runtime = [r.get("runtime_bytes") for r in ranks if r.get("runtime_bytes") is not None]
    m = Measurement(
        fingerprint=report.fingerprint or "",
        key=measurement_key(planned.spec, planned.preset, planned.hardware, p.chosen),
        kind=report.memory["kind"],
        estimate_tensor_bytes=report.estimate_tensor_bytes,
        estimate_peak_phase=str(report.plan.get("peak_phase")),
        measured_tensor_bytes=report.measured_tensor_bytes,
        measured_peak_phase=str(top.get("peak_phase")),
        estimate_phases=dict(report.plan.get("phase_tensor_bytes") or {}),
        measured_phases=phases,
        process_peak_bytes=max(process) if process else None,
        runtime_bytes=max(runtime) if runtime else None,
        time=time.time(),
        run_id=report.run_id,
    )
    store = CalibrationStore()
    store.add(m)
    return store.save()
