"""The Monitor of a preference run, a GRPO run and a run's scaling (recorded events, no launch):
reward accuracy and margin charted beside the loss for DPO (ORPO: nll and log odds), with the
latest eval's value; GRPO's reward and its latest completions (the newest rollouts file, none
with rollouts off); the speed line with the measured scaling, the communication share and the
plan's prediction; none of it for the recorded SFT run, planned before the time model."""

from __future__ import annotations

import json
from pathlib import Path

from textual.widgets import Static

from homelab_dp.app.runs import RunController
from homelab_dp.tui.widgets.chart import Chart
from tests.tui.conftest import RUN_ID, copy_run, open_monitor, plain, shows_snapshot, wait_for

DPO = [(41, 0.5, 0.0), (42, 0.625, 0.25), (43, 0.875, 0.5)]


def append(run_dir: Path, *events: dict) -> None:
    with open(run_dir / "events.jsonl", "a", encoding="utf-8") as fh:
        for e in events:
            fh.write(json.dumps(e) + "\n")


def step(n: int, **fields: object) -> dict:
    return {"type": "step", "time": 1740824300.0 + n, "step": n, "total_steps": 50, "loss": 0.6,
            "world_size": 2, "step_time_s": 2.0, "compute_seconds": 1.8, "comm_seconds": 0.4,
            **fields}  # fmt: skip


def predict(run_dir: Path) -> None:
    spec = json.loads((run_dir / "spec.json").read_text())
    spec.setdefault("plan", {})["predicted"] = {"step_seconds": 1.9, "tokens_per_s": 21000.0,
                                                "speedup_vs_one_device": 1.85}  # fmt: skip
    (run_dir / "spec.json").write_text(json.dumps(spec))


async def test_a_dpo_run_charts_reward_accuracy_and_margin_and_its_scaling(
    controller: RunController, runs_root: Path
) -> None:
    run_dir = copy_run(runs_root, "20250301-111500-dpo-0001", status="completed")
    predict(run_dir)
    append(run_dir, *(step(n, reward_accuracy=acc, reward_margin=m, rewards_chosen=m / 2,
                           rewards_rejected=-m / 2) for n, acc, m in DPO),  # fmt: skip
           {"type": "eval", "time": 1740824400.0, "step": 43, "loss": 0.5, "pairs": 8,
            "reward_accuracy": 0.75, "reward_margin": 0.375})  # fmt: skip
    async with open_monitor(controller, run_dir.name, shows_snapshot) as (app, _, _):
        screen = app.screen
        assert screen.query_one("#objective-charts").display
        accuracy = screen.query_one("#chart-reward_accuracy", Chart)
        margin = screen.query_one("#chart-reward_margin", Chart)
        assert accuracy.display and accuracy.values == [0.5, 0.625, 0.875]
        assert accuracy.border_title == "reward accuracy 0.875  eval 0.750"
        assert margin.display and margin.values == [0.0, 0.25, 0.5]
        assert margin.border_title == "reward margin 0.500  eval 0.375"
        assert not screen.query_one("#chart-nll", Chart).display
        assert not screen.query_one("#chart-log_odds_ratio", Chart).display
        assert screen.query_one("#speed", Static).display
        speed = plain(app, "#speed")
        assert "scaling 1.80× of 2 (90%), predicted 1.85× · communication 20% of the step, " \
               "10% exposed (median of 3 steps)" in speed  # fmt: skip
        assert "step 2.00 s measured, 1.90 s predicted (+5%)" in speed


async def test_an_orpo_run_charts_nll_and_log_odds(
    controller: RunController, runs_root: Path
) -> None:
    run_dir = copy_run(runs_root, "20250301-111500-orpo-0001", status="completed")
    append(run_dir, step(41, nll=1.5, log_odds_ratio=-0.25), step(42, nll=1.25, log_odds_ratio=0.5))
    async with open_monitor(controller, run_dir.name, shows_snapshot) as (app, _, _):
        screen = app.screen
        assert screen.query_one("#chart-nll", Chart).values == [1.5, 1.25]
        assert screen.query_one("#chart-log_odds_ratio", Chart).border_title == "log odds 0.500"
        assert not screen.query_one("#chart-reward_accuracy", Chart).display
        assert not screen.query_one("#chart-reward_margin", Chart).display


async def test_an_sft_run_without_a_prediction_shows_neither(controller: RunController) -> None:
    async with open_monitor(controller, RUN_ID, shows_snapshot) as (app, _, _):
        assert not app.screen.query_one("#objective-charts").display
        assert not app.screen.query_one("#speed", Static).display
        assert app.screen.query_one("#chart-loss", Chart).display


def write_rollouts(run_dir: Path, step: int, rewards: list[float]) -> None:
    folder = run_dir / "rollouts"
    folder.mkdir(exist_ok=True)
    rows = [{"prompt_index": 10 + k // 2, "completion": f"answer {step}.{k}\nsecond line",
             "reward": r, "rewards": {"length": r}} for k, r in enumerate(rewards)]  # fmt: skip
    (folder / f"step-{step:06d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


async def test_a_grpo_run_shows_its_latest_completions_as_they_come(runs_root: Path) -> None:
    """The completions panel follows the newest rollouts file, read again after each step
    event: the first 8 completions with their rewards, how many more and where."""
    run_dir = copy_run(runs_root, "20250301-111500-grpo-0001", status="completed")
    append(run_dir, step(41, reward=0.25, reward_std=0.5, reward_length=0.25,
                         completion_length=12.0, clipped=0.0))  # fmt: skip
    write_rollouts(run_dir, 41, [0.0, 0.5])
    controller = RunController(runs_root)
    async with open_monitor(controller, run_dir.name, follow_interval=0.02) as (app, pilot, _):
        await wait_for(pilot, lambda: app.screen.shown is not None, what="a snapshot")
        screen = app.screen
        assert screen.query_one("#chart-reward", Chart).values == [0.25]
        assert screen.query_one("#rollouts", Static).display
        text = plain(app, "#rollouts")
        assert "completions at step 41 (2 in all)" in text and "more in" not in text
        assert "prompt 10 reward 0.500 (length 0.500)  answer 41.1 ⏎ second line" in text
        write_rollouts(run_dir, 42, [k / 10 for k in range(10)])
        append(run_dir, step(42, reward=0.45, reward_std=0.3, completion_length=6.0))
        await wait_for(pilot, lambda: "step 42" in plain(app, "#rollouts"), what="step 42")
        text = plain(app, "#rollouts")
        assert "completions at step 42 (10 in all)" in text and "answer 42.7" in text
        assert "answer 42.8" not in text and "… 2 more in " in text
        assert "step-000042.jsonl" in text
        assert screen.query_one("#chart-reward", Chart).values == [0.25, 0.45]


async def test_a_grpo_run_without_rollouts_shows_no_completions(runs_root: Path) -> None:
    run_dir = copy_run(runs_root, "20250301-111500-grpo-0002", status="completed")
    append(run_dir, step(41, reward=0.5, reward_std=0.5, completion_length=3.0))
    async with open_monitor(RunController(runs_root), run_dir.name, shows_snapshot) as (app, _, _):
        assert app.screen.query_one("#chart-reward", Chart).values == [0.5]
        assert not app.screen.query_one("#rollouts", Static).display
