"""Screen 5, Runs: the history, following a run, resuming one."""

from __future__ import annotations

from pathlib import Path

from textual.widgets import DataTable

from homelab_dp.app.runs import RunController
from homelab_dp.tui.screens.monitor import MonitorScreen
from homelab_dp.tui.screens.runs import RunsScreen
from homelab_dp.tui.tui_app import HomelabApp
from tests.tui.conftest import RUN_ID, copy_run, open_app, wait_for

STOPPED = "20250301-091500-smollm2-135m-lora-0b1c"


async def _loaded(app: HomelabApp, pilot, count: int) -> RunsScreen:
    screen = app.screen
    assert isinstance(screen, RunsScreen)
    await wait_for(pilot, lambda: len(screen.runs) == count, what=f"{count} runs")
    return screen


async def test_history_lists_status_steps_loss_energy_and_time(runs_root: Path) -> None:
    copy_run(runs_root, STOPPED, status="interrupted")
    async with open_app(RunController(runs_root), mode="runs") as (app, pilot, _):
        await _loaded(app, pilot, 2)
        table = app.screen.query_one(DataTable)
        rows = [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]
        assert rows[0] == ["completed", "40/40", "1.480", "26.5 Wh", "2m45s", RUN_ID]  # newest
        assert rows[1][0] == "interrupted" and rows[1][-1] == STOPPED


async def test_enter_follows_the_selected_run_in_the_monitor(runs_root: Path) -> None:
    copy_run(runs_root, STOPPED, status="interrupted")
    async with open_app(RunController(runs_root), mode="runs") as (app, pilot, _):
        await _loaded(app, pilot, 2)
        await pilot.press("down", "enter")
        assert isinstance(app.screen, MonitorScreen)
        assert app.followed == STOPPED
        await wait_for(pilot, lambda: app.screen.shown is not None, what="the snapshot")
        assert app.screen.shown.run_id == STOPPED


async def test_a_run_started_elsewhere_appears_on_refresh(runs_root: Path) -> None:
    async with open_app(RunController(runs_root), mode="runs") as (app, pilot, _):
        await _loaded(app, pilot, 1)
        copy_run(runs_root, STOPPED, status="interrupted")  # e.g. `homelab-dp run` over SSH
        await pilot.press("r")
        await _loaded(app, pilot, 2)


async def test_resuming_a_completed_run_is_refused_in_cli_words(
    controller: RunController,
) -> None:
    async with open_app(controller, mode="runs") as (app, pilot, notes):
        await _loaded(app, pilot, 1)
        await pilot.press("R")
        assert notes == [
            (
                f"error: run {RUN_ID}: already completed; nothing to resume\n"
                f"hint: the result is in {controller.root / RUN_ID / 'final'}",
                "error",
            )
        ]


class ResumeRecorder(RunController):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.resumed: list[str] = []

    def resume(self, run_id: str, multinode: object = None) -> str:
        self.resumed.append(run_id)
        return run_id


async def test_resume_a_stopped_run_and_follow_it(runs_root: Path) -> None:
    copy_run(runs_root, STOPPED, status="interrupted")
    controller = ResumeRecorder(runs_root)
    async with open_app(controller, mode="runs") as (app, pilot, _):
        await _loaded(app, pilot, 2)
        await pilot.press("down", "R")
        assert controller.resumed == [STOPPED]
        assert isinstance(app.screen, MonitorScreen) and app.followed == STOPPED
