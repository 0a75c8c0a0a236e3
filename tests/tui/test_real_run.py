"""A real tiny CPU run (torchrun, 2 processes, gloo) started from the Launch screen."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import DataTable, Input

from homelab_dp.app.runs import RunController
from homelab_dp.runs.folder.run_state import ACTIVE, current_state
from homelab_dp.tui.screens.monitor import MonitorScreen
from homelab_dp.tui.screens.runs import RunsScreen
from tests.tui.conftest import open_app, wait_for


@pytest.mark.slow
@pytest.mark.usefixtures("in_repo")
async def test_launch_tiny_demo_and_see_it_complete(tmp_path: Path) -> None:
    controller = RunController(tmp_path / "runs")
    options = {"mode": "launch", "preset": "tiny-demo", "follow_interval": 0.1}
    run_id = None
    try:
        async with open_app(controller, **options) as (app, pilot, _):
            extra = app.screen.query_one("#extra", Input)
            extra.value = "train.max_steps=4 train.checkpoint_every=0"
            app.screen.set_focus(None)
            await pilot.press("s")
            # prepare imports transformers (seconds): the Monitor comes when the run started
            await wait_for(pilot, lambda: isinstance(app.screen, MonitorScreen), timeout=120)
            run_id = app.followed
            assert run_id and "tiny-demo" in run_id
            await wait_for(pilot, lambda: app.snapshot and app.snapshot.view.step >= 1, 120)
            await pilot.press("5")
            screen = app.screen
            assert isinstance(screen, RunsScreen)

            def completed() -> bool:
                row = next((r for r in screen.runs if r["run_id"] == run_id), None)
                return bool(row) and row["status"] == "completed"

            await wait_for(pilot, completed, timeout=180, what="the run to complete")
            table = screen.query_one(DataTable)
            cells = [str(c) for c in table.get_row_at(0)]
            assert cells[0] == "completed" and cells[1] == "4/4" and cells[-1] == run_id
            # The Runs table reads state.json; the followed view catches up on its next poll.
            await wait_for(
                pilot, lambda: app.snapshot.view.status == "completed", timeout=30,
                what="the followed view to see the end",
            )  # fmt: skip
    finally:
        if run_id and current_state(controller.run_dir(run_id)).get("status") in ACTIVE:
            controller.stop(run_id)  # never leave training processes behind a failed test
