"""Screen 6, Chat: a completed run's result and its base model answer the same prompt, streamed
from real `serve` processes (one CPU replica each), which stop when the screen is left."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

from textual.pilot import Pilot
from textual.widgets import Checkbox, Input, Select

from homelab_dp.app.runs import RunController
from homelab_dp.tui.screens.chat import ChatScreen
from homelab_dp.tui.tui_app import HomelabApp
from homelab_dp.tui.widgets.chat_pane import ChatPane
from tests.integration.conftest import DEMO_MODEL
from tests.tui.conftest import RUN_ID, copy_run, open_app, plain, wait_for

CHAT_RUN = "20250302-090000-tiny-llama-full-c4a7"
START_S = 240.0  # liveness bound: two servers load torch and the model on 2 busy cores (~20 s)


def completed_tiny_run(root: Path) -> Path:
    """A completed run folder whose result is the tiny demo model, trained from that model."""
    run_dir = copy_run(root, CHAT_RUN, status="completed")
    spec = json.loads((run_dir / "spec.json").read_text())
    spec["preset"]["model"]["path"] = str(DEMO_MODEL)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    shutil.copytree(DEMO_MODEL, run_dir / "final")
    return run_dir


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:
        return not _exists(pid)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def runs_listed(app) -> bool:
    """the completed runs in the chooser"""
    return isinstance(app.screen, ChatScreen) and bool(app.screen.runs)


async def test_result_and_base_answer_side_by_side(
    controller: RunController, runs_root: Path
) -> None:
    completed_tiny_run(runs_root)
    async with open_app(controller, runs_listed, mode="chat") as (app, pilot, notes):
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        screen.query_one("#chat-compare", Checkbox).value = True
        screen.query_one("#chat-max", Input).value = "6"
        screen.query_one("#chat-run", Select).value = CHAT_RUN  # starts both servers
        await pilot.pause()
        assert screen.query_one("#pane-base").display
        prompt = screen.query_one("#chat-prompt", Input)
        prompt.focus()
        await pilot.press(*"What is 2 + 2?", "enter")
        model, base = (
            screen.query_one("#pane-model", ChatPane),
            screen.query_one("#pane-base", ChatPane),
        )
        await wait_for(pilot, lambda: len(model.history) == 2 and len(base.history) == 2,
                       timeout=START_S, what="both answers")  # fmt: skip
        assert notes == [], notes
        for pane in (model, base):
            assert pane.history[0] == {"role": "user", "content": "What is 2 + 2?"}
            assert pane.answer.strip() and pane.history[1]["content"] == pane.answer
        assert model.border_title == CHAT_RUN and base.border_title == "base: tiny-llama"
        servers = list(screen.servers.values())
        assert len(servers) == 2
        pids = [p for s in servers for p in (s.pid, *s.replica_pids)]
        assert len(pids) == 4  # each server and its replica

        await pilot.press("escape", "5")  # leave the screen
        assert app.current_mode == "runs"
        await wait_for(pilot, lambda: all(gone(p) for p in pids), timeout=30,
                       what="every server process to exit")  # fmt: skip


async def test_bad_model_and_commands_start_nothing(controller: RunController) -> None:
    async with open_app(controller, mode="chat") as (app, pilot, notes):
        screen = app.screen
        field = screen.query_one("#chat-model", Input)
        field.focus()
        await pilot.press(*"no-such-model", "enter")
        await wait_for(pilot, lambda: notes, what="the error")
        assert "no such folder, and no run with that id" in notes[0][0]
        assert notes[0][1] == "error"
        assert screen.servers == {}
        prompt = screen.query_one("#chat-prompt", Input)
        prompt.focus()
        await pilot.press(*"/system Answer in French.", "enter")
        assert screen.query_one("#chat-system", Input).value == "Answer in French."
        await pilot.press(*"/nope", "enter")
        await wait_for(pilot, lambda: len(notes) == 2, what="the unknown command")
        assert "/nope: unknown command" in notes[1][0]
        await wait_for(pilot, lambda: screen.runs is not None, what="the runs listed")
        assert screen.runs == []  # the recorded run completed, but its result is not there
        assert RUN_ID in [r["run_id"] for r in controller.list_runs()]


async def test_a_server_that_exits_says_why(controller: RunController, tmp_path: Path) -> None:
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    async with open_app(controller, mode="chat") as (app, pilot, notes):
        screen = app.screen
        screen.query_one("#chat-model", Input).value = str(folder)
        prompt = screen.query_one("#chat-prompt", Input)
        prompt.focus()
        await pilot.press(*"hello", "enter")
        state = lambda: screen.states.get("pane-model", "")  # noqa: E731
        await wait_for(
            pilot, lambda: state().startswith("error"), timeout=60, what="the server's error"
        )
        assert "the server exited: error:" in state()
        assert "model_type='bert' is an encoder-only model" in state()
        assert "hint: homelab-dp fine-tunes decoder-only" in state()
        assert screen.servers == {} and not screen.busy


async def test_quitting_the_app_stops_the_server(
    controller: RunController, runs_root: Path
) -> None:
    completed_tiny_run(runs_root)
    async with open_app(controller, runs_listed, mode="chat") as (app, pilot, notes):
        screen = app.screen
        screen.query_one("#chat-max", Input).value = "4"
        screen.query_one("#chat-run", Select).value = CHAT_RUN
        await pilot.pause()
        assert not screen.query_one("#pane-base").display
        prompt = screen.query_one("#chat-prompt", Input)
        prompt.focus()
        await pilot.press(*"Hi", "enter")
        model = screen.query_one("#pane-model", ChatPane)
        # The answer is in, and the ask is over (busy is cleared just after: a prompt before
        # that only gets "wait for the answer to finish").
        await wait_for(pilot, lambda: len(model.history) == 2 and not screen.busy,
                       timeout=START_S, what="the answer")  # fmt: skip
        assert model.answer.strip()
        [server] = screen.servers.values()
        pids = [server.pid, *server.replica_pids]
        assert len(pids) == 2

        os.kill(server.pid, signal.SIGKILL)  # the server dies: the next answer says so
        await pilot.press(*"Again", "enter")
        state = lambda: screen.states.get("pane-model", "")  # noqa: E731
        # A liveness bound like the start's: on busy CI cores the failed turn took over 30 s.
        await wait_for(pilot, lambda: state().startswith("error") and not screen.busy,
                       timeout=START_S, what=lambda: f"the error (busy {screen.busy}, "
                       f"state {state()!r}, workers {list(screen.workers)}, killed pid "
                       f"{pids[0]}, history {model.history}, transcript "
                       f"{plain(app, '#pane-model .chat-transcript')[-300:]!r})")  # fmt: skip
        assert "the server exited" in state() and screen.servers == {}
        assert len(model.history) == 2  # the failed turn is not sent with the next prompt
        await pilot.press(*"Once more", "enter")  # a new server starts
        await wait_for(pilot, lambda: len(model.history) == 4, timeout=START_S, what="answer")
        [server] = screen.servers.values()
        pids += [server.pid, *server.replica_pids]
    deadline = time.monotonic() + 30  # the app has ended: nothing is left behind
    while not all(gone(p) for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if not gone(p)]
        time.sleep(0.1)


def test_chat_screen_snapshot(snap_compare, controller: RunController, runs_root: Path) -> None:
    """The followed run's result chosen, nothing started until a prompt is sent."""
    completed_tiny_run(runs_root)
    app = HomelabApp(controller, mode="chat", follow=CHAT_RUN)

    async def listed(pilot: Pilot) -> None:
        await wait_for(pilot, lambda: runs_listed(pilot.app), what="the runs listed")
        await pilot.pause()

    assert snap_compare(app, terminal_size=(80, 24), run_before=listed)
