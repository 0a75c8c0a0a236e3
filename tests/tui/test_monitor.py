"""Screen 4, Monitor: the recorded run, replayed and followed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from textual.widgets import Log

from homelab_dp.app.runs import RunController
from homelab_dp.runs.folder.jsonl_tail import read_all
from homelab_dp.runs.run_view import RunView
from homelab_dp.tui.screens.confirm import ConfirmScreen
from homelab_dp.tui.screens.monitor import MonitorScreen
from homelab_dp.tui.widgets.chart import Chart
from tests.tui.conftest import (
    RECORDED,
    RUN_ID,
    copy_run,
    open_app,
    open_monitor,
    plain,
    set_state,
    shows_snapshot,
    wait_for,
)


def _recorded_losses() -> list[float]:
    return [e["loss"] for e in read_all(RECORDED / "events.jsonl") if e["type"] == "step"]


async def test_nothing_followed_says_where_to_start(controller: RunController) -> None:
    async with open_app(controller, mode="monitor") as (app, _, _):
        assert "No run followed yet" in plain(app, "#mon-head")
        assert not app.screen.query_one("#charts").display


async def test_a_finished_run_shows_every_panel(controller: RunController) -> None:
    async with open_monitor(controller, RUN_ID, shows_snapshot) as (app, _, _):
        head = plain(app, "#mon-head")
        assert f"{RUN_ID}  completed · lora · ddp · world 2" in head
        assert "40/40  ETA done  elapsed 2m44s" in head
        assert "loss 1.4798 ↓" in head and "energy 26.5 Wh ≈ 0.01 EUR" in head
        loss_chart = app.screen.query_one("#chart-loss", Chart)
        assert loss_chart.values == _recorded_losses()
        assert loss_chart.border_title == "loss 1.480"
        tps = app.screen.query_one("#chart-tps", Chart)
        # Recorded before step events carried MFU: the figure is unknown, not zero.
        assert len(tps.values) == 40 and tps.border_title == "tokens/s 12,632  MFU n/a"
        assert "effective batch 32 = micro 4 × world 2 × accum 4" in plain(app, "#accum")
        devices = plain(app, "#devices")
        assert devices.count("est 14.6 GiB") == 2  # memory against the plan's estimate
        assert "gpu1" in devices and "66°C" in devices and "12.90 Wh" in devices
        assert "rank 1 is 23% slower than the median" in plain(app, "#stragglers")
        log = app.screen.query_one("#log", Log)
        assert log.lines[-1] == "[keeper] all workers exited 0: completed"


async def test_follows_a_run_as_it_goes(runs_root: Path) -> None:
    """Events appended after the TUI opened appear, and the end is seen."""
    alive = {"keeper": os.getpid()}
    run_dir = copy_run(
        runs_root, "20250301-121500-live-0001", status="running", events=False, pids=alive
    )
    recorded = list(read_all(RECORDED / "events.jsonl"))
    controller = RunController(runs_root)
    async with open_monitor(controller, run_dir.name, follow_interval=0.02) as (app, pilot, _):
        assert "running" in plain(app, "#mon-head")
        half = [e for e in recorded if e.get("step", 0) <= 20 and e["type"] != "state"]
        _append(run_dir / "events.jsonl", half)
        await wait_for(pilot, lambda: app.snapshot.view.step == 20, what="step 20")
        assert "20/40" in plain(app, "#mon-head")
        assert "accumulation" in plain(app, "#accum")
        _append(run_dir / "events.jsonl", [e for e in recorded if e not in half])
        set_state(run_dir, status="completed", pids={"keeper": None})
        await wait_for(pilot, lambda: app.snapshot.view.status == "completed", what="the end")
        assert app.snapshot.view.step == 40
        assert app.screen.query_one("#chart-loss", Chart).values == _recorded_losses()


async def test_the_throughput_chart_shows_the_latest_mfu(runs_root: Path) -> None:
    """A CUDA run's step events carry MFU; the tokens/s chart shows the latest one."""
    run_dir = copy_run(runs_root, "20250301-141500-mfu-0003", status="completed", events=False)
    recorded = list(read_all(RECORDED / "events.jsonl"))
    _append(
        run_dir / "events.jsonl",
        [{**e, "mfu": 0.3 + e["step"] / 400} if e["type"] == "step" else e for e in recorded],
    )
    async with open_monitor(RunController(runs_root), run_dir.name, shows_snapshot) as (app, _, _):
        assert app.snapshot.view.mfu == 0.4  # step 40
        tps = app.screen.query_one("#chart-tps", Chart)
        assert tps.border_title == "tokens/s 12,632  MFU 40%"


async def test_stop_on_a_finished_run_stops_nothing(controller: RunController) -> None:
    async with open_monitor(controller, RUN_ID, shows_snapshot) as (app, pilot, notes):
        await pilot.press("x")
        assert not isinstance(app.screen, ConfirmScreen)
        assert notes == [(f"run {RUN_ID} is completed: nothing to stop", "information")]


class StopRecorder(RunController):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.stopped: list[str] = []

    def stop(self, run_id: str, timeout: float = 1.0) -> dict[str, Any]:
        self.stopped.append(run_id)
        return {"status": "interrupted"}


async def test_stop_asks_then_stops_a_running_run(runs_root: Path) -> None:
    run_dir = copy_run(
        runs_root, "20250301-131500-busy-0002", status="running", pids={"keeper": os.getpid()}
    )
    controller = StopRecorder(runs_root)
    async with open_monitor(controller, run_dir.name, shows_snapshot) as (app, pilot, notes):
        await pilot.press("x")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")  # changed our mind
        assert isinstance(app.screen, MonitorScreen) and controller.stopped == []
        await pilot.press("x", "y")
        await wait_for(pilot, lambda: controller.stopped, what="the stop")
        assert controller.stopped == [run_dir.name]
        await wait_for(pilot, lambda: len(notes) == 2, what="the result")
        assert notes[-1] == (f"run {run_dir.name}: interrupted", "information")


def test_the_view_folds_the_recording_as_the_controller_does(controller: RunController) -> None:
    """The fixture itself: the same figures the Monitor shows, through the public API."""
    view: RunView = controller.view(RUN_ID)
    assert (view.step, view.total_steps, view.status) == (40, 40, "completed")
    assert view.last_checkpoint_step == 40 and 1 in view.stragglers


def _append(path: Path, events: list[dict[str, Any]]) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.writelines(json.dumps(e) + "\n" for e in events)
