"""The Runs screen's comparison: `runs compare`'s document (`app.compare.compare`) as a table,
one row a run, best eval loss first (GRPO runs alone: highest reward first; the settings that
differ, eval losses, rewards of preference runs, a GRPO run's reward and completion length,
scores, speed, memory, energy, duration), and each run's last sample for the same prompt side by side."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import DataTable, Static

from homelab_dp.byte_units import format_bytes
from homelab_dp.render.compare import order_text
from homelab_dp.render.text import duration

FIXED = ("#", "run", "status")
FIGURES = ("eval loss", "best (step)", "tok/s", "MFU", "peak mem", "energy", "time")
REWARDS = ("reward acc", "margin")
"""Columns of the final reward accuracy and margin, only when a run of the comparison has them
(a preference run); the last eval's in brackets."""


GRPO = ("reward", "completion")
"""Columns of a GRPO run's final mean reward (± its spread) and completion length, only when a
run of the comparison has them."""


def has_grpo(doc: dict[str, Any]) -> bool:
    """Whether any run of the comparison has a GRPO reward."""
    return any(run.get("reward") is not None for run in doc["runs"])


def _grpo(run: dict[str, Any]) -> tuple[str, str]:
    reward, spread, length = run.get("reward"), run.get("reward_std"), run.get("completion_length")
    text = "–" if reward is None else f"{reward:.3f}"
    if reward is not None and spread is not None:
        text += f" ± {spread:.3f}"
    return text, "–" if length is None else f"{length:.1f}"


def has_rewards(doc: dict[str, Any]) -> bool:
    """Whether any run of the comparison has a reward accuracy or margin."""
    keys = ("reward_accuracy", "reward_margin", "eval_reward_accuracy", "eval_reward_margin")
    return any(run.get(k) is not None for run in doc["runs"] for k in keys)


def _reward(run: dict[str, Any], name: str) -> str:
    """A final reward figure, with the last eval's in brackets: "0.875 (0.750)"."""
    final, at_eval = run.get(name), run.get(f"eval_{name}")
    text = "–" if final is None else f"{final:.3f}"
    return text + (f" ({at_eval:.3f})" if at_eval is not None else "")


def setting_text(value: Any) -> str:
    """A preset value as the preset file writes it (``true``, ``0.0003``, ``[1, 2]``)."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def score_keys(doc: dict[str, Any]) -> list[str]:
    """``task.metric`` of every numeric benchmark score of any run (stderr left out), in the
    order they first appear."""
    keys: dict[str, None] = {}
    for run in doc["runs"]:
        for task, metrics in run["scores"].items():
            for metric, value in metrics.items():
                if "stderr" not in metric and isinstance(value, (int, float)):
                    keys[f"{task}.{metric}"] = None
    return list(keys)


def compare_columns(doc: dict[str, Any]) -> list[str]:
    """The table's headers: rank, run, status, each differing setting, the figures (with the
    rewards of preference runs), then each benchmark score."""
    rewards = REWARDS if has_rewards(doc) else ()
    grpo = GRPO if has_grpo(doc) else ()
    return [*FIXED, *doc["differ"], *FIGURES[:2], *rewards, *grpo, *FIGURES[2:],
            *score_keys(doc)]  # fmt: skip


def _loss(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"


def compare_rows(doc: dict[str, Any]) -> list[list[str]]:
    """One row of cells a run, in the document's order (ranked by final eval loss)."""
    scores = score_keys(doc)
    rewards = has_rewards(doc)
    grpo = has_grpo(doc)
    rows = []
    for r in doc["runs"]:
        best = _loss(r["best_eval_loss"])
        if r["best_step"] is not None:
            best += f" ({r['best_step']})"
        tasks = r["scores"]
        rows.append(
            [
                str(r["rank"]),
                r["run_id"],
                str(r["status"]),
                *(setting_text(r["settings"].get(k)) for k in doc["differ"]),
                _loss(r["eval_loss"]),
                best,
                *((_reward(r, "reward_accuracy"), _reward(r, "reward_margin")) if rewards else ()),
                *(_grpo(r) if grpo else ()),
                "–" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}",
                "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
                "–" if r["peak_memory_bytes"] is None else format_bytes(r["peak_memory_bytes"]),
                "–" if r["energy_wh"] is None else f"{r['energy_wh']:.2f} Wh",
                duration(r["duration_s"]),
                *(
                    setting_text(tasks.get(k.split(".", 1)[0], {}).get(k.split(".", 1)[1]))
                    for k in scores
                ),
            ]
        )
    return rows


def head_text(doc: dict[str, Any]) -> str:
    """The line above the table: how many runs, the order, the settings that differ."""
    differ = ", ".join(doc["differ"]) or "none"
    return f"{len(doc['runs'])} runs, {order_text(doc)}; settings that differ: {differ}"


def sample_title(run: dict[str, Any], prompt: str) -> str:
    """A sample pane's title: the run's rank, id and the step of its last sample."""
    return f"#{run['rank']} {run['run_id']} · step {run['samples'][prompt].get('step')}"


class CompareView(Vertical):
    """The comparison of a `runs compare` document: head line, table, samples side by side."""

    def __init__(self, doc: dict[str, Any], *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.doc = doc

    def compose(self) -> ComposeResult:
        doc = self.doc
        yield Static(Text(head_text(doc)), id="compare-head")
        yield DataTable(id="compare-table", cursor_type="row", zebra_stripes=True)
        prompt = doc.get("sample_prompt")
        if prompt is None:
            yield Static(
                Text("no prompt has a sample in every run (train.sample_every)"),
                id="compare-prompt",
            )
            return
        yield Static(Text(f"last sample for: {' '.join(prompt.split())}"), id="compare-prompt")
        with VerticalScroll(id="compare-samples"), Horizontal(id="compare-sample-row"):
            for run in doc["runs"]:
                pane = Static(
                    Text(run["samples"][prompt].get("text") or ""),
                    classes="compare-sample",
                    id=f"compare-sample-{run['rank']}",
                )
                pane.border_title = sample_title(run, prompt)
                yield pane

    def on_mount(self) -> None:
        table = self.query_one("#compare-table", DataTable)
        rows = compare_rows(self.doc)
        # Widths set here, as on the Runs table: a frame drawn before DataTable measures its
        # cells would stay cached with every column as narrow as its header.
        for index, name in enumerate(compare_columns(self.doc)):
            table.add_column(name, width=max([len(name), *(len(row[index]) for row in rows)]))
        for cells in rows:
            table.add_row(*cells)
