"""Presets that remember: a completed run's figures recorded against its preset, and what a
plan of the preset may expect from them (`homelab_dp.core.preset_results` does the math).

`record_run` is the keeper's last act for a run that ended completed (`Keeper.finish`): the
figures are the ones `status --json` shows (`homelab_dp.run.controller`), written to the run's
``results.json`` and appended to the per-user store (`homelab_dp.rundir.preset_results`).
`preset_runs_for` is what `plan` reads (through `Planned.expected`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from homelab_dp.core.hardware import HardwareReport
from homelab_dp.core.preset import Preset
from homelab_dp.core.preset_results import (
    PresetRuns,
    preset_name,
    preset_runs,
    result_record,
    speed_fingerprint,
)
from homelab_dp.rundir.files import read_run_spec
from homelab_dp.rundir.preset_results import read_results, save_results
from homelab_dp.rundir.state import current_state
from homelab_dp.rundir.tail import read_all


def device_names(kind: str, names: list[str], report: HardwareReport | None = None) -> list[str]:
    """The devices of a fingerprint: the GPUs' names, or the host's CPU model once per process
    (CPU processes are all named alike: the CPU model is what tells two machines apart)."""
    if kind == "cuda":
        return list(names)
    if report is not None:
        cpu = report.host.cpu_model
    else:
        from homelab_dp.probe import nvml

        cpu = nvml.host_info().cpu_model
    return [str(cpu or "unknown CPU")] * len(names)


def run_fingerprint(spec: Any) -> dict[str, Any]:
    """The speed fingerprint of a run from its spec: the plan it was started with, with the
    batch split and checkpointing it ran with (an out-of-memory retry changes them)."""
    r = spec.resolved
    training = {**(spec.plan.get("training") or {}), "micro_batch": r.micro_batch,
                "grad_accum": r.grad_accum, "world_size": r.world_size, "dtype": r.dtype,
                "activation_checkpointing": r.activation_checkpointing}  # fmt: skip
    plan = {**spec.plan, "method": r.method, "distribution": r.distribution, "training": training}
    hw = spec.plan.get("hardware") or {}
    names = [str(d.get("name")) for d in hw.get("devices") or []]
    return speed_fingerprint(plan, spec.preset, device_names(str(hw.get("kind") or "cpu"), names))


def record_run(run_dir: Path, final: dict[str, Any]) -> dict[str, Any] | None:
    """Record a completed run's results against its preset, just before ``final`` (status,
    reason, ended) is written to its state; the record, or None when there is nothing to record
    (no preset file, a measure run, another node of a multi-node run, not completed) or it was
    recorded before. The figures are `summarize`'s: what `status` shows of the finished run."""
    from homelab_dp.run.controller import make_controller, summarize  # same layer, heavy

    spec = read_run_spec(run_dir)
    if not spec.preset.source or spec.measure_steps or spec.launch.rendezvous.node_rank != 0:
        return None
    if final.get("status") != "completed" or not spec.plan:
        return None
    state = {**current_state(run_dir), **final}
    status = summarize(run_dir, make_controller(run_dir.parent).view(str(run_dir)), state)
    started, created = state.get("started"), state.get("created")
    queued = float(started) - float(created) if started and created else 0.0
    launches = sum(1 for e in read_all(run_dir / "events.jsonl") if e.get("type") == "start")
    record = result_record(
        status,
        preset=preset_name(spec.preset.source),
        source=spec.preset.source,
        fingerprint=run_fingerprint(spec),
        launches=max(launches, 1),
        queued_s=max(queued, 0.0),
    )
    return record if save_results(run_dir, record) else None


def preset_runs_for(
    preset: Preset, plan: dict[str, Any], kind: str, names: list[str], report: Any
) -> PresetRuns | None:
    """The recorded runs of ``preset`` against a plan of it (its `plan --json` document on
    devices of ``kind`` named ``names``); None for a preset that is no file."""
    if not preset.source:
        return None
    name = preset_name(preset.source)
    fingerprint = speed_fingerprint(plan, preset, device_names(kind, names, report))
    return preset_runs(name, read_results(name), fingerprint, preset.train.max_steps or None)


def expected_runs(planned: Any) -> PresetRuns | None:
    """The recorded runs of a `Planned` preset (`homelab_dp.run.planning.Planned`) against its
    plan: what `plan` shows as expected; None for a preset that is no file."""
    hw = planned.hardware
    names = [d.name for d in hw.devices]
    return preset_runs_for(planned.preset, planned.plan.to_json(), hw.kind, names, planned.report)
