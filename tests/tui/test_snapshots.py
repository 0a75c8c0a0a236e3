"""Snapshot tests of the main screens at 80x24 (``pytest --snapshot-update`` to accept changes).

Deterministic: recorded hardware, the recorded run, no clock on screen.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import pytest
from textual.pilot import Pilot

from homelab_dp.app.runs import RunController
from homelab_dp.tui.tui_app import HomelabApp
from tests.tui.conftest import RUN_ID

SIZE = (80, 24)


def until(condition: Callable[[HomelabApp], object]) -> Callable[[Pilot], Awaitable[None]]:
    """A ``run_before`` that lets background work finish before the screenshot."""

    async def wait(pilot: Pilot) -> None:
        deadline = time.monotonic() + 10
        while not condition(pilot.app):  # type: ignore[arg-type]
            assert time.monotonic() < deadline, "the screen never settled"
            await pilot.pause(0.05)
        # What the condition saw is on screen only after the next layout and refresh (a table's
        # column widths, for one): under load the picture was once taken before them.
        await pilot.wait_for_scheduled_animations()
        await pilot.pause()
        await pilot.pause()

    return wait


@pytest.mark.usefixtures("gpus_2x3090")
def test_hardware_screen(snap_compare, controller: RunController) -> None:
    app = HomelabApp(controller)
    assert snap_compare(app, terminal_size=SIZE, run_before=until(lambda a: a.screen.report))


@pytest.mark.usefixtures("gpus_2x3090")
def test_plan_screen(snap_compare, controller: RunController) -> None:
    app = HomelabApp(controller, mode="plan", preset="smollm2-135m-lora-2x12gb")
    assert snap_compare(app, terminal_size=SIZE, run_before=until(lambda a: a.session.planned))


@pytest.mark.usefixtures("gpus_2x3090")
def test_launch_screen(snap_compare, controller: RunController) -> None:
    app = HomelabApp(controller, mode="launch", preset="tiny-demo")
    assert snap_compare(app, terminal_size=SIZE, run_before=until(lambda a: a.session.planned))


@pytest.mark.usefixtures("gpus_2x3090")
def test_monitor_screen(snap_compare, controller: RunController) -> None:
    app = HomelabApp(controller, mode="monitor", follow=RUN_ID)
    assert snap_compare(app, terminal_size=SIZE, run_before=until(lambda a: a.screen.shown))


@pytest.mark.usefixtures("gpus_2x3090")
def test_runs_screen(snap_compare, controller: RunController) -> None:
    app = HomelabApp(controller, mode="runs")
    assert snap_compare(app, terminal_size=SIZE, run_before=until(lambda a: a.screen.runs))
