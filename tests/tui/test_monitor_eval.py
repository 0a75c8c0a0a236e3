"""The Monitor's eval-loss chart (validation while training): shown once a run has eval events,
with the latest eval loss and the best; absent for a run without eval data."""

from __future__ import annotations

import json
from pathlib import Path

from homelab_dp.app.runs import RunController
from homelab_dp.tui.widgets.chart import Chart
from tests.tui.conftest import RUN_ID, copy_run, open_monitor, shows_snapshot

EVALS = [(10, 2.5), (20, 2.31), (30, 2.4), (40, 2.35)]


async def test_eval_losses_are_charted_with_the_best(
    controller: RunController, runs_root: Path
) -> None:
    run_dir = copy_run(runs_root, "20250301-111500-with-eval-0001", status="completed")
    with open(run_dir / "events.jsonl", "a", encoding="utf-8") as fh:
        for step, loss in EVALS:
            fh.write(json.dumps({"type": "eval", "step": step, "loss": loss, "tokens": 5120,
                                 "perplexity": 10.0, "seconds": 0.2}) + "\n")  # fmt: skip
    async with open_monitor(controller, run_dir.name, shows_snapshot) as (app, _, _):
        chart = app.screen.query_one("#chart-eval", Chart)
        assert chart.display and chart.values == [loss for _, loss in EVALS]
        assert chart.border_title == "eval loss 2.350  best 2.310 @ 20"
        assert chart.border_subtitle == "2.310 – 2.500"


async def test_a_run_without_eval_data_has_no_eval_chart(controller: RunController) -> None:
    async with open_monitor(controller, RUN_ID, shows_snapshot) as (app, _, _):
        assert not app.screen.query_one("#chart-eval", Chart).display
        assert app.screen.query_one("#chart-loss", Chart).display
