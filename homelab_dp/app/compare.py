"""`homelab-dp runs compare`: runs side by side, ranked by eval loss (GRPO runs, which have
none: by their final mean reward, highest first).

For each run: the preset settings that differ between the runs (flattened ``section.key``),
final and best eval loss, a preference run's final reward accuracy and margin (of its last
logged step and of its last eval), a GRPO run's final mean reward, its spread and the
completions' mean length (of its last logged step), benchmark scores (``<run>/bench.json``, written by `homelab-dp
bench`), tokens/s, MFU, peak memory, energy, duration, and its last ``sample`` event for each
prompt. Everything is read from the run folders (any run, any state); nothing is started.
The TUI's Runs view calls the same function.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from homelab_dp.app.runs import RunController
from homelab_dp.errors import HomelabError
from homelab_dp.runs.folder.jsonl_tail import read_all
from homelab_dp.runs.folder.run_folder import read_run_spec
from homelab_dp.runs.folder.run_state import current_state
from homelab_dp.runs.run_view import summarize, view_of

BENCH_FILE = "bench.json"
"""What `homelab-dp bench RUN` stores in the run folder."""
IGNORED = ("sweep.grid",)
"""Keys never compared: every point of a sweep has its grid emptied."""


def flatten(preset_doc: dict[str, Any]) -> dict[str, Any]:
    """A preset's TOML document as ``section.key`` → value."""
    return {f"{section}.{key}": value for section, table in preset_doc.items()
            for key, value in table.items()}  # fmt: skip


def read_bench(run_dir: Path) -> dict[str, dict[str, Any]]:
    """The ``tasks`` of ``bench.json`` (task → metric → value), {} when absent or unreadable."""
    try:
        doc = json.loads((run_dir / BENCH_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    tasks = doc.get("tasks") if isinstance(doc, dict) else None
    return {str(k): dict(v) for k, v in tasks.items() if isinstance(v, dict)} if isinstance(tasks, dict) else {}  # fmt: skip


def last_samples(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Each prompt's latest ``sample`` event: prompt → {step, text, tokens, seconds}."""
    out: dict[str, dict[str, Any]] = {}
    for event in read_all(run_dir / "events.jsonl"):
        if event.get("type") == "sample" and isinstance(event.get("prompt"), str):
            out[event["prompt"]] = {k: event.get(k) for k in ("step", "text", "tokens", "seconds")}
    return out


def run_entry(run_dir: Path) -> dict[str, Any]:
    """One run's figures for the comparison (all settings; `compare` keeps those that differ)."""
    spec = read_run_spec(run_dir)
    view = view_of(run_dir)
    doc = summarize(run_dir, view, current_state(run_dir))
    last, best = view.last_eval, view.best_eval
    peaks = [b for b in view.peak_memory_bytes if b]
    figures = view.objective_doc() or {}
    return {
        "run_id": run_dir.name,
        "path": str(run_dir),
        "status": doc["status"],
        "sweep_id": spec.sweep_id,
        "settings": flatten(spec.preset.to_dict()),
        "eval_loss": last.loss if last else None,
        "best_eval_loss": best.loss if best else None,
        "best_step": best.step if best else None,
        "loss": view.loss,
        "steps": view.step,
        "objective": view.objective,
        "reward_accuracy": figures.get("reward_accuracy"),
        "reward_margin": figures.get("reward_margin"),
        "eval_reward_accuracy": last.reward_accuracy if last else None,
        "eval_reward_margin": last.reward_margin if last else None,
        "reward": figures.get("reward"),
        "reward_std": figures.get("reward_std"),
        "completion_length": figures.get("completion_length"),
        "scores": read_bench(run_dir),
        "tokens_per_s": view.tokens_per_s,
        "mfu": view.mfu,
        "peak_memory_bytes": max(peaks) if peaks else None,
        "energy_wh": view.energy_wh or None,
        "duration_s": doc["duration_s"],
        "samples": last_samples(run_dir),
    }


def _rank_key(entry: dict[str, Any]) -> tuple[int, float, str]:
    loss = entry["eval_loss"]
    ok = loss is not None and math.isfinite(loss)
    return (0 if ok else 1, loss if ok else 0.0, entry["run_id"])


def _reward_key(entry: dict[str, Any]) -> tuple[int, float, str]:
    reward = entry.get("reward")
    ok = reward is not None and math.isfinite(reward)
    return (0 if ok else 1, -reward if ok else 0.0, entry["run_id"])


def sort_order(entries: list[dict[str, Any]]) -> str:
    """``eval_loss``, or ``reward`` when no run has an eval loss and one has a GRPO reward."""
    if any(e["eval_loss"] is not None for e in entries):
        return "eval_loss"
    return "reward" if any(e.get("reward") is not None for e in entries) else "eval_loss"


def rank(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The comparison document (`runs compare --json`) from run entries: sorted by final eval
    loss (runs without one last; `sort_order`: by final reward, highest first, when only GRPO
    runs have figures), ``settings`` cut to the keys whose values differ, and the prompt every
    run has a sample for (the first such prompt of the first run)."""
    keys = sorted({k for e in entries for k in e["settings"]} - set(IGNORED))
    differ = [k for k in keys
              if len({json.dumps(e["settings"].get(k), sort_keys=True) for e in entries}) > 1]  # fmt: skip
    order = sort_order(entries)
    ordered = sorted(entries, key=_reward_key if order == "reward" else _rank_key)
    common = [p for p in (ordered[0]["samples"] if ordered else {})
              if all(p in e["samples"] for e in ordered)]  # fmt: skip
    runs = []
    for place, e in enumerate(ordered, start=1):
        runs.append({**e, "rank": place, "settings": {k: e["settings"].get(k) for k in differ}})
    return {"sorted_by": order, "differ": differ,
            "sample_prompt": common[0] if common else None, "runs": runs}  # fmt: skip


def compare(controller: RunController, refs: list[str], sweep: str | None = None) -> dict[str, Any]:
    """Compare the runs named (ids, prefixes or folders) and/or every run of ``sweep``."""
    folders = [controller.run_dir(ref) for ref in refs]
    if sweep:
        found = controller.sweep_runs(sweep)
        if not found:
            raise HomelabError(
                f"--sweep {sweep}: no run of this sweep",
                hint="`homelab-dp runs --json` shows each run's sweep_id",
            )
        folders += [f for f in found if f not in folders]
    if len(folders) < 2 and not sweep:
        raise HomelabError(
            "runs compare: name at least two runs (or --sweep ID)",
            hint="e.g. homelab-dp runs compare RUN_A RUN_B; `homelab-dp runs` lists them",
        )
    return rank([run_entry(f) for f in dict.fromkeys(folders)])
