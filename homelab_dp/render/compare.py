"""Sweeps and run comparisons as text: `homelab-dp sweep`'s points and `runs compare`'s table
(the CLI prints them; the TUI's Runs view shows the same lines). Each reads the ``--json``
document, so what a person reads is what a script reads."""

from __future__ import annotations

from typing import Any

from homelab_dp.byte_units import format_bytes
from homelab_dp.render.text import duration

SAMPLE_WIDTH = 60
"""Characters of a sample's text shown in the table (the JSON has all of it)."""


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _settings(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_value(v)}" for k, v in settings.items()) or "–"


def sweep_lines(doc: dict[str, Any]) -> list[str]:
    """`homelab-dp sweep`: the sweep id, one line a point (queued run or why refused), next steps."""
    out = [f"sweep {doc['sweep_id']}: {doc['queued']} of {len(doc['points'])} points queued"]
    for p in doc["points"]:
        what = f"queued {p['run_id']}" if p["run_id"] else f"refused: {p['reason']}"
        out.append(f"  {_settings(p['settings'])}: {what}")
    out.append(f"list them: homelab-dp runs --sweep {doc['sweep_id']}")
    out.append(f"compare them: homelab-dp runs compare --sweep {doc['sweep_id']}")
    return out


def _num(v: float | None, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def _scores(scores: dict[str, dict[str, Any]]) -> str:
    parts = [f"{task}.{metric}={_value(value)}" for task, metrics in scores.items()
             for metric, value in metrics.items()
             if "stderr" not in metric and isinstance(value, (int, float))]  # fmt: skip
    return ", ".join(parts) or "–"


def _clip(text: str) -> str:
    one = " ".join(str(text).split())
    return one if len(one) <= SAMPLE_WIDTH else one[: SAMPLE_WIDTH - 1] + "…"


def rewards_text(run: dict[str, Any]) -> str | None:
    """A preference run's final reward accuracy and margin, and its last eval's: "accuracy
    0.875, margin 0.500; eval accuracy 0.750, margin 0.375"; a GRPO run's final mean reward:
    "reward 0.750 ± 0.250, completion 4.1 tokens" (None: the run has none of them)."""
    parts = []
    for prefix, word in (("", ""), ("eval_", "eval ")):
        acc, margin = run.get(f"{prefix}reward_accuracy"), run.get(f"{prefix}reward_margin")
        if acc is not None or margin is not None:
            parts.append(f"{word}accuracy {_num(acc, '.3f')}, margin {_num(margin, '.3f')}")
    if run.get("reward") is not None:  # GRPO
        spread = run.get("reward_std")
        text = f"reward {run['reward']:.3f}" + (f" ± {spread:.3f}" if spread is not None else "")
        if run.get("completion_length") is not None:
            text += f", completion {run['completion_length']:.1f} tokens"
        parts.append(text)
    return "; ".join(parts) or None


def order_text(doc: dict[str, Any]) -> str:
    """How the runs are ranked: "best eval loss first" or (GRPO) "highest reward first"."""
    return "highest reward first" if doc.get("sorted_by") == "reward" else "best eval loss first"


def compare_lines(doc: dict[str, Any]) -> list[str]:
    """`runs compare`: one block a run, best eval loss (GRPO: highest reward) first."""
    runs = doc["runs"]
    if not runs:
        return ["no runs to compare"]
    out = [f"{len(runs)} runs, {order_text(doc)}; settings that differ: "
           + (", ".join(doc["differ"]) or "none")]  # fmt: skip
    head = f"{'#':>2} {'eval loss':>9} {'best':>9} {'tok/s':>8} {'MFU':>6} {'peak mem':>10} {'energy':>9} {'time':>7}  run"  # fmt: skip
    out.append(head)
    for r in runs:
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        peak = "–" if r["peak_memory_bytes"] is None else format_bytes(r["peak_memory_bytes"])
        energy = "–" if r["energy_wh"] is None else f"{r['energy_wh']:.2f} Wh"
        out.append(
            f"{r['rank']:>2} {_num(r['eval_loss'], '.4f'):>9} {_num(r['best_eval_loss'], '.4f'):>9}"
            f" {_num(r['tokens_per_s'], '.0f'):>8} {mfu:>6} {peak:>10} {energy:>9}"
            f" {duration(r['duration_s']):>7}  {r['run_id']} ({r['status']})"
        )
        out.append(f"   settings: {_settings(r['settings'])}")
        rewards = rewards_text(r)
        if rewards:
            out.append(f"   rewards: {rewards}")
        if r["scores"]:
            out.append(f"   scores: {_scores(r['scores'])}")
    prompt = doc.get("sample_prompt")
    if prompt is not None:
        out.append(f"last sample for: {_clip(prompt)}")
        for r in runs:
            s = r["samples"][prompt]
            out.append(f"{r['rank']:>2} step {s.get('step')}: {_clip(s.get('text') or '')}")
    return out
