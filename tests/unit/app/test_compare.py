"""`runs compare` on recorded run folders (no launch): the settings that differ, ranked by final
eval loss, best eval loss, benchmark scores from bench.json, each run's last sample for the
same prompt; the text table shows the same numbers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from homelab_dp.app.compare import compare
from homelab_dp.app.runs import make_controller
from homelab_dp.render.compare import compare_lines
from tests.conftest import DATA, run_cli

RECORDED = DATA / "events" / "20250301-101500-smollm2-135m-lora-7f3a"


def recorded_run(
    root: Path, run_id: str, *, lr: float, evals: list[float], sweep: str | None = "sweep-x"
) -> Path:
    """A copy of the recorded run with its own id, learning rate, sweep and eval losses, and
    two samples of one prompt (the later one is the last) and one of another."""
    run_dir = root / run_id
    shutil.copytree(RECORDED, run_dir)
    spec = json.loads((run_dir / "spec.json").read_text())
    spec["run_id"] = run_id
    spec["preset"]["train"]["lr"] = lr
    if sweep:
        spec["sweep"] = {"id": sweep, "point": {"train.lr": lr}}
    (run_dir / "spec.json").write_text(json.dumps(spec))
    lines = [
        {"type": "eval", "step": 10 * (i + 1), "loss": loss, "tokens": 100, "seconds": 1.0}
        for i, loss in enumerate(evals)
    ] + [
        {"type": "sample", "step": 10, "prompt": "Say hi", "text": f"early {run_id}",
         "tokens": 3, "seconds": 0.1},
        {"type": "sample", "step": 20, "prompt": "Say hi", "text": f"late {run_id}",
         "tokens": 3, "seconds": 0.1},
        {"type": "sample", "step": 20, "prompt": f"only {run_id}", "text": "x", "tokens": 1,
         "seconds": 0.1},
    ]  # fmt: skip
    with (run_dir / "events.jsonl").open("a") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    return run_dir


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    root.mkdir()
    recorded_run(root, "run-a", lr=1e-4, evals=[2.0, 1.5, 1.7])  # final 1.7, best 1.5
    recorded_run(root, "run-b", lr=3e-4, evals=[1.9, 1.2])  # final 1.2: first
    recorded_run(root, "run-c", lr=1e-3, evals=[], sweep=None)  # no eval: last
    bench = {"model": "run-b", "tasks": {"tiny": {"acc": 0.75, "stderr": 0.1}}, "seconds": 3}
    (root / "run-b" / "bench.json").write_text(json.dumps(bench))
    return root


def test_compare_ranks_by_final_eval_loss_with_settings_scores_and_samples(runs: Path) -> None:
    doc = compare(make_controller(runs), ["run-a", "run-c", "run-b"])
    assert [r["run_id"] for r in doc["runs"]] == ["run-b", "run-a", "run-c"]
    assert [r["rank"] for r in doc["runs"]] == [1, 2, 3]
    assert doc["differ"] == ["train.lr"]  # only the learning rate differs
    b, a, c = doc["runs"]
    assert b["settings"] == {"train.lr": 3e-4} and c["settings"] == {"train.lr": 1e-3}
    assert (a["eval_loss"], a["best_eval_loss"], a["best_step"]) == (1.7, 1.5, 20)
    assert c["eval_loss"] is None and c["best_eval_loss"] is None
    assert b["scores"] == {"tiny": {"acc": 0.75, "stderr": 0.1}} and a["scores"] == {}
    assert doc["sample_prompt"] == "Say hi"  # the prompt every run has a sample for
    assert b["samples"]["Say hi"]["text"] == "late run-b"  # the last one of the prompt
    assert b["tokens_per_s"] is not None and b["energy_wh"] == pytest.approx(a["energy_wh"])
    assert b["peak_memory_bytes"] > 0 and b["duration_s"] > 0
    lines = compare_lines(doc)
    assert lines[0] == "3 runs, best eval loss first; settings that differ: train.lr"
    assert lines[2].split()[:3] == ["1", "1.2000", "1.2000"] and "run-b" in lines[2]
    assert "settings: train.lr=0.0003" in lines[3] and "scores: tiny.acc=0.75" in lines[4]
    assert lines[-4:] == ["last sample for: Say hi", " 1 step 20: late run-b",
                          " 2 step 20: late run-a", " 3 step 20: late run-c"]  # fmt: skip


def test_compare_a_sweep_and_the_json_keys(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "--runs", str(runs), "runs", "compare", "--sweep", "sweep-x",
                           "--json")  # fmt: skip
    assert rc == 0, err
    doc = json.loads(out)
    assert [r["run_id"] for r in doc["runs"]] == ["run-b", "run-a"]  # run-c is not in the sweep
    assert set(doc) == {"sorted_by", "differ", "sample_prompt", "runs"}
    assert set(doc["runs"][0]) == {
        "rank", "run_id", "path", "status", "sweep_id", "settings", "eval_loss",
        "best_eval_loss", "best_step", "loss", "steps", "objective", "reward_accuracy",
        "reward_margin", "eval_reward_accuracy", "eval_reward_margin", "reward", "reward_std",
        "completion_length", "scores", "tokens_per_s", "mfu",
        "peak_memory_bytes", "energy_wh", "duration_s", "samples",
    }  # fmt: skip
    rc, out, _ = run_cli(capsys, "--runs", str(runs), "runs", "--sweep", "sweep-x", "--json")
    assert rc == 0 and sorted(r["run_id"] for r in json.loads(out)) == ["run-a", "run-b"]


def test_compare_needs_two_runs_or_a_known_sweep(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = run_cli(capsys, "--runs", str(runs), "runs", "compare", "run-a")
    assert rc == 2 and "error: runs compare: name at least two runs" in err and "hint:" in err
    rc, _, err = run_cli(capsys, "--runs", str(runs), "runs", "compare", "--sweep", "nope")
    assert rc == 2 and "error: --sweep nope: no run of this sweep" in err and "hint:" in err
