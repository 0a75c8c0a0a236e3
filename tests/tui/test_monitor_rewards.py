"""The Monitor of a preference run and of a run's scaling (recorded events, no launch): reward
accuracy and margin charted beside the loss for DPO (ORPO: nll and log odds), with the latest
eval's value; the speed line with the measured scaling, the communication share and the plan's
prediction; none of it for the recorded SFT run, planned before the time model."""

from __future__ import annotations

import json
from pathlib import Path

from textual.widgets import Static

from homelab_dp.app.runs import RunController
from homelab_dp.tui.widgets.chart import Chart
from tests.tui.conftest import RUN_ID, copy_run, open_monitor, plain, shows_snapshot

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
