"""TUI fixtures: recorded hardware, a runs folder holding the recorded run, the app under Pilot,
helpers to wait."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import io
import json
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from rich.console import Console
from textual.pilot import Pilot
from textual.widgets import Static

from homelab_dp.app.runs import RunController, make_controller
from homelab_dp.runs.folder.run_state import process_start
from homelab_dp.tui.tui_app import HomelabApp
from tests.conftest import DATA

RUN_ID = "20250301-101500-smollm2-135m-lora-7f3a"
RECORDED = DATA / "events" / RUN_ID
NVML_ENV = "HOMELAB_DP_FAKE_NVML"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run ``async def`` tests (Pilot needs an event loop) without an asyncio plugin."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    asyncio.run(pyfuncitem.obj(**{name: pyfuncitem.funcargs[name] for name in names}))
    return True


def use_gpus(monkeypatch: pytest.MonkeyPatch, recording: str) -> None:
    """Answer NVML from ``tests/data/nvml/<recording>.json`` (a relative path: the same
    text on every machine, because the Hardware screen names the recording)."""
    monkeypatch.setenv(NVML_ENV, f"tests/data/nvml/{recording}.json")


@pytest.fixture
def gpus_2x3090(in_repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_gpus(monkeypatch, "2x3090-nvlink")


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
    """A runs folder holding a copy of the recorded, completed run."""
    root = tmp_path / "runs"
    root.mkdir()
    shutil.copytree(RECORDED, root / RUN_ID)
    return root


@pytest.fixture
def controller(runs_root: Path) -> RunController:
    return make_controller(runs_root)


def copy_run(
    root: Path, run_id: str, *, status: str, events: bool = True, pids: dict | None = None
) -> Path:
    """Another run folder from the recording, with its own id and status (no process unless
    ``pids`` names one: ``{"keeper": os.getpid()}`` makes the run look alive; each pid is
    recorded with its start time, as the keeper records it, so it counts as the run's)."""
    run_dir = root / run_id
    shutil.copytree(RECORDED, run_dir)
    state = json.loads((run_dir / "state.json").read_text())
    state.update(status=status, run_id=run_id, created=state["created"] - 3600)
    if pids is not None:
        state["pids"] = pids
        state["starts"] = {str(p): process_start(p) for p in pids.values() if p}
    (run_dir / "state.json").write_text(json.dumps(state))
    spec = json.loads((run_dir / "spec.json").read_text())
    spec["run_id"] = run_id
    (run_dir / "spec.json").write_text(json.dumps(spec))
    if not events:
        (run_dir / "events.jsonl").write_text("")
        (run_dir / "devices.jsonl").write_text("")
        (run_dir / "logs" / "launcher.log").write_text("")
    return run_dir


def set_state(run_dir: Path, **changes: Any) -> None:
    """Change fields of a run folder's state.json (as the keeper would)."""
    state = json.loads((run_dir / "state.json").read_text())
    state.update(changes)
    (run_dir / "state.json").write_text(json.dumps(state))


def capture_notifications(app: HomelabApp) -> list[tuple[str, str]]:
    """Record (message, severity) of every notification the app shows from now on."""
    seen: list[tuple[str, str]] = []
    original = app.notify

    def notify(message: str, *args: Any, **kwargs: Any) -> None:
        seen.append((str(message), str(kwargs.get("severity", "information"))))
        original(message, *args, **kwargs)

    app.notify = notify  # type: ignore[method-assign]
    return seen


async def wait_for(
    pilot: Pilot,
    condition: Callable[[], object],
    timeout: float = 10.0,
    what: str | Callable[[], str] = "",
) -> None:
    """Let the app run until ``condition()`` is true (thread workers finish on their own time).
    ``what`` names the wait in the failure; a callable is asked then (what the app showed)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout} s waiting for {said or condition}")
        await pilot.pause(0.05)
    await pilot.pause()


def plain(app: HomelabApp, selector: str, width: int = 200) -> str:
    """The text of a Static on the current screen, wide enough not to wrap."""
    content = app.screen.query_one(selector, Static).content
    console = Console(width=width, file=io.StringIO(), color_system=None)
    with console.capture() as captured:
        console.print(content)
    return captured.get()


class Opened(NamedTuple):
    """The app under Pilot, and every notification it showed since it started."""

    app: HomelabApp
    pilot: Pilot
    notes: list[tuple[str, str]]


def has_snapshot(app: HomelabApp) -> bool:
    """the first snapshot"""
    return app.snapshot is not None


def shows_snapshot(app: HomelabApp) -> bool:
    """the Monitor to show a snapshot"""
    return app.screen.shown is not None


@contextlib.asynccontextmanager
async def open_app(
    controller: RunController,
    ready: Callable[[HomelabApp], object] | None = None,
    **options: Any,
) -> AsyncIterator[Opened]:
    """``HomelabApp(controller, **options)`` under Pilot, its notifications recorded from the
    start; entered once ``ready(app)`` holds (its docstring says what is awaited), or after one
    pause without ``ready``."""
    app = HomelabApp(controller, **options)
    async with app.run_test() as pilot:
        notes = capture_notifications(app)
        if ready is None:
            await pilot.pause()
        else:
            await wait_for(pilot, lambda: ready(app), what=ready.__doc__ or "")
        yield Opened(app, pilot, notes)


def open_monitor(
    controller: RunController,
    run_id: str,
    ready: Callable[[HomelabApp], object] = has_snapshot,
    **options: Any,
) -> contextlib.AbstractAsyncContextManager[Opened]:
    """The Monitor following ``run_id``, entered once the first snapshot has arrived."""
    return open_app(controller, ready, mode="monitor", follow=run_id, **options)
