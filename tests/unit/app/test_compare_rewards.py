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


def grpo_events(run_dir: Path, rewards: list[float]) -> None:
    lines = [{"type": "step", "step": 40 + i, "total_steps": 50, "loss": 0.1, "world_size": 2,
              "reward": r, "reward_std": 0.25, "reward_length": r, "completion_length": 4.5,
              "clipped": 0.0} for i, r in enumerate(rewards, start=1)]  # fmt: skip
    with (run_dir / "events.jsonl").open("a") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)


def test_compare_ranks_grpo_runs_by_their_final_reward(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    root.mkdir()
    grpo_events(recorded_run(root, "grpo-a", lr=1e-5, evals=[]), [0.9, 0.5])
    grpo_events(recorded_run(root, "grpo-b", lr=1e-4, evals=[]), [0.1, 0.75])
    recorded_run(root, "sft-c", lr=3e-4, evals=[])
    doc = compare(make_controller(root), ["grpo-a", "grpo-b", "sft-c"])
    assert doc["sorted_by"] == "reward"  # no run has an eval loss: the highest final reward
    assert [r["run_id"] for r in doc["runs"]] == ["grpo-b", "grpo-a", "sft-c"]
    b = doc["runs"][0]
    assert (b["reward"], b["reward_std"], b["completion_length"]) == (0.75, 0.25, 4.5)
    lines = compare_lines(doc)
    assert lines[0].startswith("3 runs, highest reward first")
    assert "   rewards: reward 0.750 ± 0.250, completion 4.5 tokens" in lines
    heads, rows = compare_columns(doc), compare_rows(doc)
    at = heads.index("reward")
    assert heads[at : at + 2] == ["reward", "completion"] and "reward acc" not in heads
    cells = {row[1]: row[at : at + 2] for row in rows}
    assert cells == {"grpo-b": ["0.750 ± 0.250", "4.5"], "grpo-a": ["0.500 ± 0.250", "4.5"],
                     "sft-c": ["–", "–"]}  # fmt: skip
    # a run with an eval loss: the usual order, by eval loss
    recorded_run(root, "sft-d", lr=1e-3, evals=[1.0])
    doc = compare(make_controller(root), ["grpo-a", "sft-d"])
    assert doc["sorted_by"] == "eval_loss" and doc["runs"][0]["run_id"] == "sft-d"
    assert compare_lines(doc)[0].startswith("2 runs, best eval loss first")
