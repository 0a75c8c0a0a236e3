"""RunView of a preference run and of a run's measured scaling: the history of each objective
figure (DPO/KTO rewards, ORPO nll and log odds), the eval's figures, live scaling as the median of
the latest logged steps, the plan's prediction beside it, and all of it in ``status --json``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from homelab_dp.runs.folder.run_state import current_state
from homelab_dp.runs.run_view import SCALING_STEPS, RunView, summarize, view_of
from tests.conftest import DATA, run_cli

RECORDED = DATA / "events" / "20250301-101500-smollm2-135m-lora-7f3a"


def step(n: int, **fields: object) -> dict:
    return {"type": "step", "time": 100.0 + n, "step": n, "total_steps": 20, "loss": 0.7 - n / 100,
            "world_size": 2, **fields}  # fmt: skip


def dpo(n: int, acc: float, margin: float) -> dict:
    return step(n, rewards_chosen=margin / 2, rewards_rejected=-margin / 2, reward_margin=margin,
                reward_accuracy=acc)  # fmt: skip


def test_a_dpo_runs_rewards_are_kept_step_by_step() -> None:
    v = RunView()
    v.apply({"type": "start", "time": 100.0, "objective": "dpo", "world_size": 2})
    for n, (acc, margin) in enumerate([(0.5, 0.0), (0.625, 0.125), (0.875, 0.5)], start=1):
        v.apply(dpo(n, acc, margin))
    assert v.objective == "dpo"
    assert v.series("reward_accuracy") == [0.5, 0.625, 0.875]
    assert v.series("reward_margin") == [0.0, 0.125, 0.5]
    assert v.series("nll") == []
    assert v.objective_doc() == {"rewards_chosen": 0.25, "rewards_rejected": -0.25,
                                 "reward_margin": 0.5, "reward_accuracy": 0.875}  # fmt: skip
    copied = v.copy()
    v.apply(dpo(4, 1.0, 0.75))
    assert copied.series("reward_accuracy") == [0.5, 0.625, 0.875]  # a copy shares nothing


def test_orpo_keeps_nll_and_log_odds_and_sft_keeps_nothing() -> None:
    v = RunView()
    v.apply(step(1, nll=1.5, log_odds_ratio=-0.5))
    v.apply(step(2, nll=1.25, log_odds_ratio=0.25))
    assert v.objective_doc() == {"nll": 1.25, "log_odds_ratio": 0.25}
    assert v.series("reward_accuracy") == []
    sft = RunView()
    sft.apply(step(1))
    assert sft.objective_doc() is None and sft.figures == {}


def test_a_damaged_reward_leaves_the_view_as_it_was() -> None:
    v = RunView()
    v.apply(dpo(1, 0.5, 0.25))
    v.apply(step(2, reward_accuracy="high"))
    assert v.skipped_events == 1 and v.series("reward_accuracy") == [0.5] and v.step == 1


def test_eval_doc_carries_the_evals_pairs_and_rewards() -> None:
    v = RunView()
    v.apply({"type": "eval", "time": 1.0, "step": 10, "loss": 0.55, "tokens": 900, "pairs": 16,
             "reward_accuracy": 0.75, "reward_margin": 0.3})  # fmt: skip
    doc = v.eval_doc()
    assert doc is not None
    assert (doc["pairs"], doc["reward_accuracy"], doc["reward_margin"]) == (16, 0.75, 0.3)
    assert "nll" not in doc


def test_scaling_is_the_median_of_the_latest_steps() -> None:
    v = RunView()
    v.apply({"type": "start", "time": 100.0, "world_size": 2})
    # A slow first step (warm-up), then steady steps: one step alone would mislead.
    v.apply(step(1, step_time_s=4.0, compute_seconds=1.0, comm_seconds=3.0))
    for n in range(2, 2 + SCALING_STEPS):
        v.apply(step(n, step_time_s=1.0, compute_seconds=0.91 + n / 1000, comm_seconds=0.2))
    s = v.scaling
    assert s is not None and s.steps == SCALING_STEPS and s.world == 2
    median_compute = 0.91 + 4 / 1000  # of steps 2..6
    assert s.speedup == pytest.approx(2 * median_compute)
    assert s.efficiency == pytest.approx(median_compute)
    assert s.comm_share == pytest.approx(0.2)  # partly hidden behind the backward…
    assert s.exposed_share == pytest.approx(1 - median_compute)  # …this much was not
    assert s.step_time_s == 1.0


def test_one_process_has_no_scaling_and_older_events_neither() -> None:
    one = RunView()
    one.apply({"type": "start", "time": 100.0, "world_size": 1})
    one.apply(step(1, world_size=1, step_time_s=0.5))
    assert one.scaling is None and one.measured_step_s == 0.5
    older = RunView()
    older.apply(step(1, step_time_s=1.0))  # written before comm/compute existed
    assert older.scaling is None


def test_speed_doc_puts_the_plans_prediction_beside_the_measurement() -> None:
    v = RunView(world_size=2, predicted={"step_seconds": 0.8, "tokens_per_s": 1200.0,
                                         "speedup_vs_one_device": 1.9, "bottleneck": "compute",
                                         "exposed_comm_seconds": 0.06})  # fmt: skip
    for n in range(1, 4):
        v.apply(step(n, step_time_s=1.0, compute_seconds=0.9, comm_seconds=0.1,
                     tokens_per_s=1000.0))  # fmt: skip
    assert v.speed_doc() == {
        "predicted_step_seconds": 0.8, "measured_step_seconds": 1.0,
        "predicted_tokens_per_s": 1200.0, "measured_tokens_per_s": 1000.0,
        "predicted_speedup": 1.9, "measured_speedup": pytest.approx(1.8),
        "predicted_exposed_share": pytest.approx(0.075),
        "measured_exposed_share": pytest.approx(0.1),
    }  # fmt: skip
    old = RunView(predicted={"step_seconds": 0.8})  # a partial block: what it has, no more
    assert old.speed_doc()["predicted_tokens_per_s"] is None  # type: ignore[index]
    assert RunView().speed_doc() is None  # a plan without a prediction


def copy_recorded(tmp_path: Path, predicted: dict | None) -> Path:
    run_dir = tmp_path / RECORDED.name
    shutil.copytree(RECORDED, run_dir)
    spec = json.loads((run_dir / "spec.json").read_text())
    if predicted is not None:
        spec.setdefault("plan", {})["predicted"] = predicted
    (run_dir / "spec.json").write_text(json.dumps(spec))
    with open(run_dir / "events.jsonl", "a", encoding="utf-8") as fh:
        for n in (41, 42, 43):
            fh.write(json.dumps(dpo(n, 0.75, 0.5) | {"step_time_s": 2.0, "compute_seconds": 1.8,
                                                     "comm_seconds": 0.4}) + "\n")  # fmt: skip
    return run_dir


def test_status_json_has_objective_figures_scaling_and_prediction(tmp_path: Path) -> None:
    run_dir = copy_recorded(tmp_path, {"step_seconds": 1.9, "tokens_per_s": 21000.0,
                                       "speedup_vs_one_device": 1.85})  # fmt: skip
    doc = json.loads(json.dumps(summarize(run_dir, view_of(run_dir), current_state(run_dir))))
    assert doc["objective_figures"]["reward_accuracy"] == 0.75
    assert doc["objective_figures"]["reward_margin"] == 0.5
    assert doc["scaling"]["speedup"] == pytest.approx(1.8)
    assert doc["scaling"]["efficiency"] == pytest.approx(0.9)
    assert doc["scaling"]["comm_share"] == pytest.approx(0.2)
    assert doc["speed"]["predicted_step_seconds"] == 1.9
    assert doc["speed"]["measured_step_seconds"] == 2.0
    assert doc["speed"]["predicted_speedup"] == 1.85


def test_a_run_planned_before_the_time_model_has_no_speed(tmp_path: Path) -> None:
    run_dir = copy_recorded(tmp_path, None)
    doc = summarize(run_dir, view_of(run_dir), current_state(run_dir))
    assert doc["speed"] is None and doc["objective"] == "sft"  # the recorded spec's objective
    assert doc["scaling"] is not None  # measured all the same


def test_the_status_command_prints_them_and_its_json_holds_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = copy_recorded(tmp_path, {"step_seconds": 1.9, "tokens_per_s": 21000.0,
                                       "speedup_vs_one_device": 1.85})  # fmt: skip
    rc, out, err = run_cli(capsys, "--runs", str(tmp_path), "status", run_dir.name)
    assert rc == 0, err
    assert "scaling   1.80× of 2 (90%), predicted 1.85×; communication 20% of the step, " \
           "10% exposed" in out  # fmt: skip
    assert "predicted step 2.00 s measured, 1.90 s predicted (+5%)" in out
    assert "reward accuracy 0.750, margin 0.500 (chosen 0.250, rejected -0.250)" in out
    rc, out, err = run_cli(capsys, "--runs", str(tmp_path), "status", run_dir.name, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["scaling"]["world"] == 2 and doc["speed"]["predicted_speedup"] == 1.85
    assert doc["objective_figures"]["reward_margin"] == 0.5


def test_a_resume_measures_its_scaling_afresh() -> None:
    v = RunView()
    v.apply({"type": "start", "time": 1.0, "world_size": 2})
    for n in (1, 2, 3):
        v.apply(step(n, step_time_s=1.0, compute_seconds=0.5, comm_seconds=0.5))
    # Resumed on 2 processes again but on a quieter machine: only the new steps count.
    v.apply({"type": "start", "time": 9.0, "world_size": 2, "start_step": 3})
    assert v.scaling is None
    v.apply(step(4, step_time_s=1.0, compute_seconds=0.95, comm_seconds=0.1))
    assert v.scaling is not None and v.scaling.speedup == pytest.approx(1.9)
