"""Screen 3, Launch: the equivalent command, starting in the background, saving presets."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from textual.widgets import Input, Select

from homelab_dp.app.runs import RunController
from homelab_dp.byte_units import GiB
from homelab_dp.planning.plan_result import Fit
from homelab_dp.presets.preset_store import user_presets_dir
from homelab_dp.tui.screens.launch import LaunchScreen
from homelab_dp.tui.screens.monitor import MonitorScreen
from homelab_dp.tui.screens.plan import field_id
from tests.tui.conftest import RUN_ID, open_app, plain, wait_for

SMOLLM = "smollm2-135m-lora-2x12gb"


IDENTICAL = "warning: pairs.jsonl: 2 pairs with identical chosen and rejected responses left out"
PREPARED = SimpleNamespace(warnings=(IDENTICAL,))
"""What `RunController.prepare` returns, as far as the Launch screen reads it."""


class StubController(RunController):
    """The real controller, except that prepare/start only record what they were given."""

    def __init__(self, root: Path, prepared: Any = PREPARED) -> None:
        super().__init__(root)
        self.prepared: list[dict[str, Any]] = []
        self.started: list[dict[str, Any]] = []
        self.release = threading.Event()
        self.answer = prepared

    def prepare(self, preset_ref: str, **kwargs: Any) -> Any:
        self.prepared.append({"preset": preset_ref, **kwargs})
        assert self.release.wait(10), "the test never let prepare finish"
        return self.answer

    def start(self, prepared: Any, **options: Any) -> str:
        assert prepared is self.answer
        self.started.append(options)
        return RUN_ID  # the recorded run stands in for the new one


@pytest.mark.usefixtures("gpus_2x3090")
async def test_edits_become_the_equivalent_cli_command(controller: RunController) -> None:
    async with open_app(controller, mode="plan", preset=SMOLLM) as (app, pilot, _):
        app.screen.query_one(f"#{field_id('train.micro_batch')}", Input).value = "2"
        await pilot.pause(0.4)  # the debounce
        await pilot.press("3")
        assert isinstance(app.screen, LaunchScreen)
        app.screen.query_one("#extra", Input).value = "train.max_steps=10"
        await pilot.pause()
        command = plain(app, "#launch-command")
        assert command.strip() == (
            f"homelab-dp run {SMOLLM} --set train.micro_batch=2 --set train.max_steps=10"
        )
        summary = plain(app, "#launch-summary")
        assert "plan: fits · LoRA · ddp · cuda × 2 · effective batch 16" in summary


@pytest.mark.usefixtures("gpus_2x3090")
async def test_start_prepares_off_the_ui_thread_then_follows_the_run(runs_root: Path) -> None:
    controller = StubController(runs_root)
    async with open_app(controller, mode="launch", preset="tiny-demo") as (app, pilot, notes):
        app.screen.query_one("#extra", Input).value = "train.max_steps=4"
        app.screen.set_focus(None)
        await pilot.press("s")
        await wait_for(pilot, lambda: controller.prepared, what="prepare")
        # prepare is still running in its thread: the UI answers keys meanwhile
        assert "preparing" in plain(app, "#launch-status")
        await pilot.press("s")  # a second start while preparing is refused
        assert any("already being prepared" in text for text, _ in notes)
        controller.release.set()
        await wait_for(pilot, lambda: isinstance(app.screen, MonitorScreen), what="the Monitor")
        assert controller.prepared == [
            {
                "preset": "tiny-demo",
                "overrides": ["train.max_steps=4"],
                "gpus": None,
                "force": False,
            }
        ]
        assert app.followed == RUN_ID
        assert any(text.startswith(f"started run {RUN_ID}") for text, _ in notes)
        assert (IDENTICAL, "warning") in notes  # what the checks said but did not refuse


@pytest.mark.usefixtures("gpus_2x3090")
async def test_a_refused_launch_says_why_in_cli_words(controller: RunController) -> None:
    async with open_app(controller, mode="launch", preset="tiny-demo") as (app, pilot, notes):
        app.session.gpus = "2x24GiB"  # sizes are for what-if plans, not for runs
        app.screen.set_focus(None)
        await pilot.press("s")
        await wait_for(pilot, lambda: not app.screen.launching, what="the refusal")
        (error,) = [text for text, severity in notes if severity == "error"]
        assert error.splitlines()[0] == (
            "error: --gpus 2x24GiB: `run` uses real devices; sizes are for `plan` what-ifs"
        )
        assert error.splitlines()[1].startswith("hint: choose GPUs with hardware.devices")
        assert controller.list_runs()[0]["run_id"] == RUN_ID  # no run folder was made
        assert len(controller.list_runs()) == 1
        assert isinstance(app.screen, LaunchScreen)


@pytest.mark.usefixtures("gpus_2x3090")
async def test_save_writes_a_preset_with_a_header_and_the_edits(controller: RunController) -> None:
    async with open_app(controller, mode="plan", preset=SMOLLM) as (app, pilot, notes):
        app.session.edits["lora.r"] = "8"
        await pilot.press("3")
        name = app.screen.query_one("#save-name", Input)
        name.focus()
        await pilot.press(*"my-lora", "enter")
        path = user_presets_dir() / "my-lora.toml"
        text = path.read_text()
        assert text.startswith("# homelab-dp run my-lora\n")
        assert "r = 8\n" in text
        assert f"saved {path}" in plain(app, "#launch-status")
        await pilot.press("enter")  # again, without overwrite: refused as the CLI refuses it
        error = [text for text, severity in notes if severity == "error"][-1]
        assert error == (
            f"error: presets save: {path} already exists\nhint: choose another name or pass --force"
        )
        await pilot.press("escape", "2")  # the Plan screen now offers the new preset
        app.screen.query_one("#preset", Select).value = "my-lora"  # raises if not offered
        await pilot.pause()
        assert app.session.preset_name == "my-lora"
        assert app.session.open().lora.r == 8


@pytest.mark.usefixtures("gpus_2x3090")
async def test_auto_fit_key_launches_with_the_found_micro_batch(runs_root: Path) -> None:
    """The TUI's auto-fit is `run --auto-fit`: the app fits the batch in prepare, the keeper
    retries after out-of-memory; the screen says which micro-batch the run takes."""
    fit = Fit(micro_batch=16, grad_accum=1, world_size=2, requested_effective_batch=32,
              total_bytes=3 * GiB, limit_bytes=4 * GiB, fits=True)  # fmt: skip
    controller = StubController(runs_root, SimpleNamespace(warnings=(), fit=fit))
    async with open_app(controller, mode="launch", preset="tiny-demo") as (app, pilot, notes):
        app.screen.set_focus(None)
        assert "--auto-fit" not in plain(app, "#launch-command")
        await pilot.press("a")
        await pilot.pause()
        assert plain(app, "#launch-command").strip() == "homelab-dp run tiny-demo --auto-fit"
        controller.release.set()
        await pilot.press("s")
        await wait_for(pilot, lambda: isinstance(app.screen, MonitorScreen), what="the Monitor")
    assert controller.prepared == [
        {"preset": "tiny-demo", "overrides": [], "gpus": None, "force": False, "auto_fit": True}
    ]
    assert controller.started == [{"auto_fit": True}]
    assert any("16 is the largest micro-batch that fits" in text for text, _ in notes)
