"""What the runs of a preset measured, and what they let a plan expect (pure: stdlib only).

When a run ends completed (or early-stopped, which completes it), the keeper records its figures
against its preset: one `result_record` per run, keyed by the preset's name (its file's stem),
with a `speed_fingerprint` of everything its speed depends on — the model's size, method,
distribution, activation checkpointing, world size, the devices (GPU names, or the CPU model),
micro-batch, accumulation, sequence length, dtype, packing, optimizer and compile. The figures
are `status --json`'s (`homelab_dp.runs.run_view.summarize`), so a record says what `status`
said of the finished run. Failed and interrupted runs are not recorded: a run stopped half-way
says nothing about how long the whole one takes.

A plan of the preset then looks at the records with the same fingerprint (`expect`):

* tokens/s: the median of the runs' tokens/s (each run's last logged step, as `status` shows);
* the planned tokens: the planned optimizer steps (``train.max_steps``, or, for a preset that
  counts epochs, the recorded runs' planned steps) × the median real tokens a step;
* duration: planned tokens / tokens/s plus the median fixed time of a run — its wall time less
  its tokens / tokens/s (loading, the first steps, evaluations, checkpoints, saving), from runs
  of one launch (a resumed run's wall time holds the pause);
* energy: the median energy per token × the planned tokens (None when no run measured energy,
  e.g. on the CPU).

Records of other hardware or settings give no expectation; `PresetRuns.differences` says how
the newest of them differs.

A record also keeps the run's speed in the steady state beside what its plan predicted
(`steady_speed`: the medians of the step events after the first `STEADY_AFTER` steps — tokens/s,
step time, and with several processes the communication it waited on, `train.parallelism.comm_timing`),
so a plan can be checked against what the run then did; the keeper hands the same figures to
the time model's calibration (`homelab_dp.planning.speed_calibration.record_speed`).

Where the results of completed runs are kept: the run's ``results.json`` and the per-user
store ``$XDG_DATA_HOME/homelab-dp/preset_results.jsonl`` (one JSON line per run).

Each line is one `homelab_dp.runs.preset_results.result_record`, appended like the run index
(`homelab_dp.runs.folder.run_index.register`): one ``O_APPEND`` write of a whole line into a file private
to the user, so runs that end at the same moment never tear each other's lines. A run is
recorded once: its ``results.json`` is written first, and a run folder that has one is not
appended again.

Presets that remember: a completed run's figures recorded against its preset, and what a
plan of the preset may expect from them (`homelab_dp.runs.preset_results` does the math).

`record_run` is the keeper's last act for a run that ended completed (`Keeper.finish`): the
figures are the ones `status --json` shows (`homelab_dp.app.runs`), written to the run's
``results.json`` and appended to the per-user store (`homelab_dp.runs.preset_results`).
`preset_runs_for` is what `plan` reads (through `Planned.expected`).
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from homelab_dp import json_safe
from homelab_dp.presets.preset import Preset
from homelab_dp.probe import nvml
from homelab_dp.probe.hardware import HardwareReport
from homelab_dp.runs.folder.jsonl_tail import read_all
from homelab_dp.runs.folder.run_folder import read_run_spec
from homelab_dp.runs.folder.run_state import current_state
from homelab_dp.runs.run_view import summarize, view_of
from homelab_dp.user_files.paths import data_home, ensure_private_dir

RECORD_VERSION = 1
STEADY_AFTER = 3
"""Step events up to this step are left out of a run's steady speed: the first steps pay for
allocation, DDP's bucket rebuild and the optimizer state's creation."""
PREDICTED_KEYS = ("step_seconds", "compute_seconds", "comm_seconds", "exposed_comm_seconds",
                  "offload_seconds", "tokens_per_s", "speedup_vs_one_device",
                  "scaling_efficiency", "bottleneck")  # fmt: skip
"""What a record keeps of its plan's ``predicted`` block (the time model's figures)."""
MODEL_KEYS = ("params", "layers", "hidden", "vocab", "trainable_params")
"""The plan's model block: the size of what is trained (LoRA rank and targets change the last)."""


def preset_name(source: str | Path) -> str:
    """The name a preset's results are kept under: its file's stem (``tiny-demo``)."""
    return Path(source).stem


def speed_fingerprint(plan: dict[str, Any], preset: Preset, devices: list[str]) -> dict[str, Any]:
    """What a run's speed depends on, from its plan (the `plan --json` document), its preset and
    its devices (GPU names in plan order, or ``[cpu model] × processes``). Two runs with equal
    fingerprints ran the same work on the same kind of hardware."""
    t = plan.get("training") or {}
    model = plan.get("model") or {}
    return {
        "model": {k: model.get(k) for k in MODEL_KEYS},
        "method": plan.get("method"),
        "distribution": plan.get("distribution"),
        "activation_checkpointing": t.get("activation_checkpointing"),
        "world_size": t.get("world_size"),
        "devices": list(devices),
        "micro_batch": t.get("micro_batch"),
        "grad_accum": t.get("grad_accum"),
        "seq_len": t.get("seq_len"),
        "dtype": t.get("dtype"),
        "packed": preset.data.pack,
        "optimizer": preset.train.optimizer,
        "compile": preset.train.compile,
    }


def fingerprint_differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """How a recorded fingerprint differs from a plan's: ``"world_size 2 (this plan 1)"``."""
    out = []
    for key in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(key), ours.get(key)
        if a == b:
            continue
        if key == "devices":
            a, b = _devices_text(a or []), _devices_text(b or [])
        elif key == "model":
            a = (a or {}).get("trainable_params"), (a or {}).get("params")
            b = (b or {}).get("trainable_params"), (b or {}).get("params")
            a, b = f"{a[0]} of {a[1]} params trained", f"{b[0]} of {b[1]}"
        out.append(f"{key} {a} (this plan {b})")
    return out


def _devices_text(names: list[str]) -> str:
    """``2× NVIDIA H200`` or ``NVIDIA A10 + NVIDIA L4``."""
    if not names:
        return "none"
    if len(set(names)) == 1:
        return f"{len(names)}× {names[0]}"
    return " + ".join(names)


def _median(values: list[Any]) -> float | None:
    nums = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return statistics.median(nums) if nums else None


def steady_speed(events: list[dict[str, Any]], after: int = STEADY_AFTER) -> dict[str, Any] | None:
    """A run's speed once settled, from its events: the medians over the step events after
    step ``after`` (all of them if the run logged none later) of ``tokens_per_s``,
    ``step_time_s`` (as ``step_seconds``), ``comm_seconds`` and ``compute_seconds``, with
    ``comm_share`` (exposed communication ÷ step time, 0 with one process) and ``steps`` (how
    many step events); None without a step event that measured tokens/s."""
    steps = [e for e in events if e.get("type") == "step" and e.get("tokens_per_s")]
    if not steps:
        return None
    steady = [e for e in steps if int(e.get("step") or 0) > after] or steps
    step_s = _median([e.get("step_time_s") for e in steady])
    compute = _median([e.get("compute_seconds") for e in steady])
    share = None
    if step_s and compute is not None:
        share = max(0.0, 1.0 - compute / step_s)
    elif int(steady[-1].get("world_size") or 1) == 1:
        share = 0.0
    return {
        "tokens_per_s": _median([e.get("tokens_per_s") for e in steady]),
        "step_seconds": step_s,
        "comm_seconds": _median([e.get("comm_seconds") for e in steady]),
        "compute_seconds": compute,
        "comm_share": share,
        "steps": len(steady),
    }


def predicted_of(plan: dict[str, Any]) -> dict[str, Any] | None:
    """The time model's figures of a plan document (its ``predicted`` block, `PREDICTED_KEYS`
    only); None for a plan made before the time model."""
    predicted = plan.get("predicted")
    if not isinstance(predicted, dict):
        return None
    return {k: predicted.get(k) for k in PREDICTED_KEYS}


def prediction_error(record: dict[str, Any]) -> float | None:
    """Measured ÷ predicted tokens/s − 1 of a record (0.1: the run was 10% faster than its
    plan said); None when either is missing."""
    measured = (record.get("measured") or {}).get("tokens_per_s")
    predicted = (record.get("predicted") or {}).get("tokens_per_s")
    if not measured or not predicted:
        return None
    return float(measured) / float(predicted) - 1.0


def result_record(
    status: dict[str, Any],
    *,
    preset: str,
    source: str,
    fingerprint: dict[str, Any],
    launches: int = 1,
    queued_s: float = 0.0,
    measured: dict[str, Any] | None = None,
    predicted: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One run's record from its `status --json` document (a completed run); ``measured`` its
    `steady_speed`, ``predicted`` its plan's `predicted_of` (each None when not known)."""
    ev = status.get("eval") or {}
    return {
        "version": RECORD_VERSION,
        "preset": preset,
        "source": source,
        "run_id": status.get("run_id"),
        "path": status.get("path"),
        "time": (status.get("created") or 0.0) + (status.get("duration_s") or 0.0),
        "status": status.get("status"),
        "reason": status.get("reason"),
        "fingerprint": fingerprint,
        "tokens_per_s": status.get("tokens_per_s"),
        "mfu": status.get("mfu"),
        "peak_memory_bytes": list(status.get("peak_memory_bytes") or []),
        "energy_wh": status.get("energy_wh"),
        "wall_s": status.get("duration_s"),
        "queued_s": queued_s,
        "launches": launches,
        "steps": status.get("step"),
        "total_steps": status.get("total_steps"),
        "tokens": status.get("tokens"),
        "final_loss": status.get("loss"),
        "eval_loss": ev.get("loss"),
        "measured": measured,
        "predicted": predicted,
    }


def _usable(record: dict[str, Any]) -> bool:
    """A record whose speed can be used: tokens, steps and tokens/s all measured."""
    return all(
        isinstance(record.get(k), (int, float)) and record[k] > 0
        for k in ("tokens_per_s", "tokens", "steps")
    )


def _fixed_s(record: dict[str, Any]) -> float:
    """A run's time beyond its tokens at its tokens/s (not its time in the queue)."""
    busy = float(record["wall_s"]) - float(record.get("queued_s") or 0.0)
    return max(busy - float(record["tokens"]) / float(record["tokens_per_s"]), 0.0)


@dataclass(frozen=True)
class Expectation:
    """How long a planned run should take and the energy it should use, from recorded runs."""

    duration_s: float
    energy_wh: float | None
    """None when none of the runs measured energy (the CPU, or no power readings)."""
    from_runs: int
    tokens_per_s: float
    """The median of the runs' tokens/s."""
    steps: int
    """Optimizer steps of the planned run."""
    steps_from: str
    """"preset" (train.max_steps) or "recorded runs" (a preset that counts epochs)."""
    tokens: int
    """Real tokens of the planned run: steps × the runs' median tokens a step."""
    fixed_s: float
    """The median time of a run beyond its tokens / tokens/s (load, evaluations, saving)."""
    run_ids: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The plan's ``expected`` block."""
        return {
            "duration_s": self.duration_s,
            "energy_wh": self.energy_wh,
            "from_runs": self.from_runs,
            "tokens_per_s": self.tokens_per_s,
            "steps": self.steps,
            "steps_from": self.steps_from,
            "tokens": self.tokens,
            "fixed_s": self.fixed_s,
            "run_ids": list(self.run_ids),
        }


def expect(records: list[dict[str, Any]], planned_steps: int | None) -> Expectation | None:
    """What ``records`` (runs of one fingerprint) say of a run of ``planned_steps`` optimizer
    steps (None or 0: as many as the recorded runs planned). None without a usable record."""
    runs = [r for r in records if _usable(r)]
    if not runs:
        return None
    tps = statistics.median(float(r["tokens_per_s"]) for r in runs)
    per_step = statistics.median(float(r["tokens"]) / float(r["steps"]) for r in runs)
    steps_from = "preset"
    if not planned_steps:
        steps_from = "recorded runs"
        planned_steps = int(
            statistics.median(int(r.get("total_steps") or r["steps"]) for r in runs)
        )
    tokens = planned_steps * per_step
    whole = [r for r in runs if int(r.get("launches") or 1) == 1 and r.get("wall_s")]
    fixed = statistics.median(_fixed_s(r) for r in whole) if whole else 0.0
    metered = [r for r in runs if (r.get("energy_wh") or 0) > 0]
    energy = None
    if metered:
        energy = statistics.median(float(r["energy_wh"]) / float(r["tokens"]) for r in metered)
        energy *= tokens
    return Expectation(
        duration_s=fixed + tokens / tps,
        energy_wh=energy,
        from_runs=len(runs),
        tokens_per_s=tps,
        steps=int(planned_steps),
        steps_from=steps_from,
        tokens=int(round(tokens)),
        fixed_s=fixed,
        run_ids=tuple(str(r.get("run_id")) for r in runs),
    )


@dataclass(frozen=True)
class PresetRuns:
    """The recorded runs of one preset as a plan sees them: those of its fingerprint and others."""

    preset: str
    same: tuple[dict[str, Any], ...] = ()
    other: tuple[dict[str, Any], ...] = ()
    expectation: Expectation | None = None
    differences: tuple[str, ...] = field(default=())
    """How the newest record of other hardware or settings differs from the plan."""

    def to_json(self) -> dict[str, Any]:
        """The keys `plan --json` gains: ``expected`` (or null) and ``recorded_runs``."""
        return {
            "expected": self.expectation.to_json() if self.expectation else None,
            "recorded_runs": {
                "preset": self.preset,
                "same_settings": len(self.same),
                "other_settings": len(self.other),
                "differences": list(self.differences),
            },
        }


def preset_runs(
    name: str,
    records: list[dict[str, Any]],
    fingerprint: dict[str, Any],
    planned_steps: int | None,
) -> PresetRuns:
    """Split the records of preset ``name`` by ``fingerprint``; the expectation of the same."""
    mine = [r for r in records if r.get("preset") == name]
    same = [r for r in mine if r.get("fingerprint") == fingerprint]
    other = [r for r in mine if r.get("fingerprint") != fingerprint]
    diffs: list[str] = []
    if other:
        newest = max(other, key=lambda r: r.get("time") or 0.0)
        diffs = fingerprint_differences(newest.get("fingerprint") or {}, fingerprint)
    return PresetRuns(name, tuple(same), tuple(other), expect(same, planned_steps), tuple(diffs))


STORE_NAME = "preset_results.jsonl"
RUN_RESULTS = "results.json"


def results_path() -> Path:
    """The per-user store of run results."""
    return data_home() / STORE_NAME


def run_results_path(run_dir: Path) -> Path:
    """A run's own record of its results."""
    return run_dir / RUN_RESULTS


def save_results(run_dir: Path, record: dict[str, Any]) -> bool:
    """Write ``run_dir/results.json`` and append ``record`` to the store; False (nothing
    written) when the run was recorded before."""
    own = run_results_path(run_dir)
    try:
        fd = os.open(own, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json_safe.dump(record, fh, indent=1)
        fh.write("\n")
    append_result(record)
    return True


def append_result(record: dict[str, Any]) -> None:
    """One line in the per-user store (one O_APPEND write, file 0600)."""
    ensure_private_dir(data_home())
    data = (json_safe.dumps(record) + "\n").encode("utf-8")
    fd = os.open(results_path(), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        written = os.write(fd, data)
    finally:
        os.close(fd)
    if written != len(data):
        raise OSError(f"{results_path()}: short write ({written} of {len(data)} bytes)")


def read_results(preset: str | None = None) -> list[dict[str, Any]]:
    """The stored records, oldest first (only preset ``preset``'s when given); a torn line (a
    crash mid-write) or an unreadable file is skipped, never an error."""
    try:
        text = results_path().read_text(encoding="utf-8")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and (preset is None or doc.get("preset") == preset):
            out.append(doc)
    return out


def device_names(kind: str, names: list[str], report: HardwareReport | None = None) -> list[str]:
    """The devices of a fingerprint: the GPUs' names, or the host's CPU model once per process
    (CPU processes are all named alike: the CPU model is what tells two machines apart)."""
    if kind == "cuda":
        return list(names)
    cpu = report.host.cpu_model if report is not None else nvml.host_info().cpu_model
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
    spec = read_run_spec(run_dir)
    if not spec.preset.source or spec.measure_steps or spec.launch.rendezvous.node_rank != 0:
        return None
    if final.get("status") != "completed" or not spec.plan:
        return None
    state = {**current_state(run_dir), **final}
    status = summarize(run_dir, view_of(run_dir), state)
    started, created = state.get("started"), state.get("created")
    queued = float(started) - float(created) if started and created else 0.0
    events = list(read_all(run_dir / "events.jsonl"))
    launches = sum(1 for e in events if e.get("type") == "start")
    record = result_record(
        status,
        preset=preset_name(spec.preset.source),
        source=spec.preset.source,
        fingerprint=run_fingerprint(spec),
        launches=max(launches, 1),
        queued_s=max(queued, 0.0),
        measured=steady_speed(events),
        predicted=predicted_of(spec.plan),
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
    """The recorded runs of a `Planned` preset (`homelab_dp.app.plan.Planned`) against its
    plan: what `plan` shows as expected; None for a preset that is no file."""
    hw = planned.hardware
    names = [d.name for d in hw.devices]
    return preset_runs_for(planned.preset, planned.plan.to_json(), hw.kind, names, planned.report)
