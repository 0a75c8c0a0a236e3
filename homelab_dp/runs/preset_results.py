"""What the runs of a preset measured, and what they let a plan expect (pure: stdlib only).

When a run ends completed (or early-stopped, which completes it), the keeper records its figures
against its preset: one `result_record` per run, keyed by the preset's name (its file's stem),
with a `speed_fingerprint` of everything its speed depends on — the model's size, method,
distribution, activation checkpointing, world size, the devices (GPU names, or the CPU model),
micro-batch, accumulation, sequence length, dtype, packing, optimizer and compile. The figures
are `status --json`'s (`homelab_dp.run.controller.summarize`), so a record says what `status`
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
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from homelab_dp.core.preset import Preset

RECORD_VERSION = 1
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


def result_record(
    status: dict[str, Any],
    *,
    preset: str,
    source: str,
    fingerprint: dict[str, Any],
    launches: int = 1,
    queued_s: float = 0.0,
) -> dict[str, Any]:
    """One run's record from its `status --json` document (a completed run)."""
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
