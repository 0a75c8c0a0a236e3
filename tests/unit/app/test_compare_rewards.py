"""`runs compare` of preference runs (recorded folders, no launch): each run's final reward
accuracy and margin (its last logged step) and its last eval's, in the JSON, the text and the
TUI's table; SFT runs compared alone keep the table they had."""

from __future__ import annotations

import json
from pathlib import Path

from homelab_dp.app.compare import compare
from homelab_dp.app.runs import make_controller
from homelab_dp.render.compare import compare_lines
from homelab_dp.tui.widgets.run_compare import compare_columns, compare_rows
from tests.unit.app.test_compare import recorded_run


def dpo_events(run_dir: Path, accuracy: list[float], eval_accuracy: float) -> None:
    lines = [
        {"type": "step", "step": 40 + i, "total_steps": 50, "loss": 0.6, "world_size": 2,
         "reward_accuracy": acc, "reward_margin": acc / 2}
        for i, acc in enumerate(accuracy, start=1)
    ] + [{"type": "eval", "step": 45, "loss": 0.5, "pairs": 8, "tokens": 100,
          "reward_accuracy": eval_accuracy, "reward_margin": 0.25}]  # fmt: skip
    with (run_dir / "events.jsonl").open("a") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)


def test_compare_shows_final_rewards_of_preference_runs(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    root.mkdir()
    dpo_events(recorded_run(root, "dpo-a", lr=1e-5, evals=[]), [0.5, 0.875], 0.75)
    recorded_run(root, "sft-b", lr=1e-4, evals=[])
    doc = compare(make_controller(root), ["dpo-a", "sft-b"])
    a = next(r for r in doc["runs"] if r["run_id"] == "dpo-a")
    b = next(r for r in doc["runs"] if r["run_id"] == "sft-b")
    assert (a["reward_accuracy"], a["reward_margin"]) == (0.875, 0.4375)  # the last step's
    assert (a["eval_reward_accuracy"], a["eval_reward_margin"]) == (0.75, 0.25)
    assert b["reward_accuracy"] is None and b["eval_reward_margin"] is None
    lines = compare_lines(doc)
    assert "   rewards: accuracy 0.875, margin 0.438; eval accuracy 0.750, margin 0.250" in lines
    assert sum("rewards:" in line for line in lines) == 1  # the SFT run has none
    heads, rows = compare_columns(doc), compare_rows(doc)
    assert heads[5:8] == ["best (step)", "reward acc", "margin"]
    cells = {row[1]: row[6:8] for row in rows}
    assert cells == {"dpo-a": ["0.875 (0.750)", "0.438 (0.250)"], "sft-b": ["–", "–"]}


def test_sft_runs_alone_have_no_reward_columns(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    root.mkdir()
    for name, lr in (("sft-a", 1e-4), ("sft-b", 3e-4)):
        recorded_run(root, name, lr=lr, evals=[1.0])
    doc = compare(make_controller(root), ["sft-a", "sft-b"])
    assert "reward acc" not in compare_columns(doc)
    assert all(len(row) == len(compare_columns(doc)) for row in compare_rows(doc))
    assert not any("rewards:" in line for line in compare_lines(doc))
