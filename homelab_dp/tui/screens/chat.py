"""Screen 6, Chat: try a run's result, optionally beside its base model (the same prompt to both).

The models run in background `serve` processes (`homelab_dp.app.chat_server`), never in the
TUI's process: it stays responsive and never initialises CUDA. A model's server starts when it
is chosen (or with the first prompt), answers stream into its pane token by token, and leaving
the screen (or the app) stops every server.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import Checkbox, Footer, Header, Input, Label, Select, Static

from homelab_dp.app.chat_server import STOP_WAIT_S, ChatServer, LocalServer, ServerFailed
from homelab_dp.app.chat_session import chat_targets, server_cards
from homelab_dp.app.follow import Following
from homelab_dp.app.runs import RunController
from homelab_dp.errors import HomelabError
from homelab_dp.tui.messages import UserError
from homelab_dp.tui.widgets.chat_pane import ChatPane

PANES = ("pane-model", "pane-base")
LABELS = {"pane-model": "result", "pane-base": "base"}
HELP = "enter: send · /reset · /system TEXT · esc, then 1-6: other screens"


class ChatScreen(Screen[None]):
    """Choose a completed run (or type a model), then chat; one pane per model."""

    BINDINGS = [
        Binding("escape", "blur", "Leave field", show=False),
        Binding("ctrl+r", "reset", "Reset chat"),
    ]
    AUTO_FOCUS = "#chat-prompt"

    def __init__(self, controller: RunController, following: Following) -> None:
        super().__init__()
        self.controller = controller
        self.following = following
        self.servers: dict[str, ChatServer] = {}
        """The running server of each pane, by pane id."""
        self.states: dict[str, str] = {}
        """What each pane's server is doing, in words."""
        self.busy = False
        self.runs: list[str] | None = None
        """The completed runs with a result, newest first (None until listed)."""
        self._folder: Path | None = None
        self._http: aiohttp.ClientSession | None = None
        self._gpus: list[str] | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="chat-choose", classes="row"):
            yield Select([], prompt="completed run", id="chat-run", compact=True)
            yield Input(placeholder="or a run id / model folder", id="chat-model", compact=True)
            yield Checkbox("compare with base", id="chat-compare", compact=True)
        with Horizontal(id="chat-settings", classes="row"):
            yield Label("temperature")
            yield Input("0.7", id="chat-temp", type="number", compact=True)
            yield Label("max tokens")
            yield Input("128", id="chat-max", type="integer", compact=True)
            yield Input(placeholder="system prompt", id="chat-system", compact=True)
        yield Static("Choose a completed run, then type a prompt.", id="chat-state")
        with Horizontal(id="chat-panes"):
            yield ChatPane("model", id="pane-model")
            yield ChatPane("base model", id="pane-base")
        yield Input(placeholder="Type a prompt · " + HELP, id="chat-prompt", compact=True)
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "6 Chat"
        self.query_one("#pane-base").display = False
        self._load_runs()
        self.set_interval(1.0, self._tick)

    def on_screen_resume(self) -> None:
        if self.is_mounted:
            self._load_runs()

    def on_screen_suspend(self) -> None:
        """Leaving the screen stops the servers (a model holds memory while it is served)."""
        self.stop_servers()

    async def on_unmount(self) -> None:
        """The app is ending: stop the servers and wait for them (no worker runs any more)."""
        self.workers.cancel_node(self)
        servers, self.servers = list(self.servers.values()), {}
        for server in servers:
            server.terminate()
        for server in servers:
            server.stop()
        if self._http is not None:
            await self._http.close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    # ------------------------------------------------------------------ choosing the model
    @work(thread=True, exclusive=True, group="chat-runs", exit_on_error=False)
    def _load_runs(self) -> None:
        runs = [r["run_id"] for r in self.controller.list_runs()
                if r["status"] == "completed" and (Path(r["path"]) / "final").is_dir()]  # fmt: skip
        self.app.call_from_thread(self._show_runs, runs)

    def _show_runs(self, runs: list[str]) -> None:
        self.runs = runs
        select = self.query_one("#chat-run", Select)
        chosen = select.value
        with self.prevent(Select.Changed):  # listing runs must not start a server
            select.set_options([(r, r) for r in runs])
            if chosen in runs:
                select.value = chosen
            elif not self.model and self.following.run_id in runs:
                select.value = self.following.run_id
                self.query_one("#chat-model", Input).value = self.following.run_id

    @property
    def model(self) -> str:
        """The MODEL chosen: a run id, a run folder or a model folder."""
        return self.query_one("#chat-model", Input).value.strip()

    @property
    def compare(self) -> bool:
        return self.query_one("#chat-compare", Checkbox).value

    @on(Select.Changed, "#chat-run")
    def _run_chosen(self, event: Select.Changed) -> None:
        if event.value is Select.NULL:
            return
        self.query_one("#chat-model", Input).value = str(event.value)
        self.choose()

    @on(Input.Submitted, "#chat-model")
    def _model_typed(self) -> None:
        self.choose()

    @on(Checkbox.Changed, "#chat-compare")
    def _compare_toggled(self) -> None:
        """Show or hide the base's pane; both conversations start again, side by side."""
        self.query_one("#pane-base").display = self.compare
        self.action_reset()
        base = self.servers.pop("pane-base", None)
        self.states.pop("pane-base", None)
        if base is not None:
            base.terminate()
            self._reap([base])
        self._show_state()
        if self.model and self.compare:
            self._start()

    def choose(self) -> None:
        """Another model or compare setting: stop the servers, start the new ones."""
        self.stop_servers()
        for pane_id in PANES:
            self.query_one(f"#{pane_id}", ChatPane).reset()
        if self.model:
            self._start()

    @work(exclusive=True, group="chat-start", exit_on_error=False)
    async def _start(self) -> None:
        try:
            await self._ready(self._targets())
        except HomelabError as exc:
            self._error(exc)
        except ServerFailed:
            pass  # on the state line already; the next prompt tries again

    # ------------------------------------------------------------------ servers
    def _targets(self) -> dict[str, str]:
        """The MODEL argument of each pane shown. Raises HomelabError."""
        targets = chat_targets(self.model, self.controller.root, compare=self.compare)
        panes = {}
        for pane_id, (title, folder) in zip(PANES, targets, strict=False):
            self.query_one(f"#{pane_id}", ChatPane).border_title = title
            panes[pane_id] = folder
        return panes

    def _cards(self) -> list[str]:
        """The GPUs a server may use (UUID or index), none on a machine without them."""
        if self._gpus is None:
            self._gpus = server_cards()
        return self._gpus

    async def _ready(self, targets: dict[str, str]) -> dict[str, ChatServer]:
        """Start what is not running yet and wait until every server answers."""
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="homelab-dp-chat-"))  # 0700
        if self._http is None:
            self._http = aiohttp.ClientSession()
        cards = self._cards()
        for i, (pane_id, model) in enumerate(targets.items()):
            if pane_id not in self.servers:
                # With two cards the base gets the second one; else both share what there is.
                card = cards[i % len(cards)] if cards else None
                server = ChatServer(model, log=self._folder / f"{pane_id}-{time.time_ns()}.log",
                                    cpu=not cards, cuda_visible=card)  # fmt: skip
                server.start()
                self.servers[pane_id] = server
                self._state(pane_id, "starting the model…")
        servers = {p: self.servers[p] for p in targets}
        await asyncio.gather(*(self._wait(p, s) for p, s in servers.items()))
        return servers

    async def _wait(self, pane_id: str, server: ChatServer) -> None:
        try:
            await server.wait_ready(self._http)
        except ServerFailed as exc:
            if self.servers.get(pane_id) is server:
                del self.servers[pane_id]
            self._state(pane_id, f"error: {exc}")
            raise
        if self.servers.get(pane_id) is server:
            self._state(pane_id, f"ready on {server.device or 'its device'} (pid {server.pid})")

    def stop_servers(self) -> None:
        """SIGTERM every server's process group; a thread waits for them to go."""
        self.workers.cancel_group(self, "chat-start")
        self.workers.cancel_group(self, "chat-ask")
        servers, self.servers = list(self.servers.values()), {}
        self.states.clear()
        self.busy = False  # a cancelled answer never finishes by itself
        for server in servers:
            server.terminate()
        if servers:
            self._reap(servers)
        self._show_state()

    @work(thread=True, group="chat-reap", exit_on_error=False)
    def _reap(self, servers: list[ChatServer]) -> None:
        for server in servers:
            server.stop()

    def _state(self, pane_id: str, text: str) -> None:
        self.states[pane_id] = text
        self._show_state()

    def _show_state(self) -> None:
        out = Text(" · ").join(
            Text.assemble(
                (f"{LABELS[p]}: ", "bold"),
                (self.states[p], "bold red" if self.states[p].startswith("error") else ""),
            )
            for p in PANES
            if p in self.states
        )
        self.query_one("#chat-state", Static).update(out or HELP)

    def _tick(self) -> None:
        """The waiting time of servers still starting."""
        for pane_id, server in self.servers.items():
            if self.states.get(pane_id, "").startswith("starting"):
                waited = int(time.monotonic() - server.started)
                self._state(pane_id, f"starting the model… {waited} s")

    # ------------------------------------------------------------------ chatting
    @on(Input.Submitted, "#chat-prompt")
    def _submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        event.input.value = ""
        if not text:
            return
        if text == "/reset":
            self.action_reset()
        elif text == "/system" or text.startswith("/system "):
            self.query_one("#chat-system", Input).value = text[len("/system") :].strip()
            self.action_reset()
        elif text.startswith("/"):
            self._error(HomelabError(f"{text.split()[0]}: unknown command", hint=HELP))
        elif self.busy:
            self.app.notify("wait for the answer to finish", severity="warning")
        elif not self.model:
            self._error(HomelabError("no model chosen", hint="choose a completed run first"))
        else:
            try:
                settings = self._settings()
            except HomelabError as exc:
                self._error(exc)
                return
            self.busy = True
            self._ask(text, settings)

    def _settings(self) -> dict[str, Any]:
        """Temperature and max tokens from their fields. Raises HomelabError."""
        try:
            temperature = float(self.query_one("#chat-temp", Input).value)
            max_tokens = int(self.query_one("#chat-max", Input).value)
        except ValueError:
            raise HomelabError("temperature and max tokens must be numbers",
                               hint="e.g. temperature 0.7, max tokens 128") from None  # fmt: skip
        if not 0 <= temperature <= 2 or max_tokens < 1:
            raise HomelabError(f"temperature {temperature} / max tokens {max_tokens}",
                               hint="temperature from 0 to 2, max tokens at least 1")  # fmt: skip
        return {"temperature": temperature, "max_tokens": max_tokens}

    @work(exclusive=True, group="chat-ask", exit_on_error=False)
    async def _ask(self, prompt: str, settings: dict[str, Any]) -> None:
        try:
            servers = await self._ready(self._targets())
            await asyncio.gather(
                *(self._answer(p, s, prompt, settings) for p, s in servers.items())
            )
        except HomelabError as exc:
            self._error(exc)
        except ServerFailed:
            pass  # shown on the state line by _wait
        except Exception as exc:  # a fault of ours: shown, not left as a pane that never answers
            for pane_id in self.servers:
                self._state(pane_id, f"error: {type(exc).__name__}: {exc}")
            raise
        finally:
            self.busy = False

    async def _answer(
        self, pane_id: str, server: ChatServer, prompt: str, settings: dict[str, Any]
    ) -> None:
        pane = self.query_one(f"#{pane_id}", ChatPane)
        session = pane.session
        session.system = self.query_one("#chat-system", Input).value.strip()
        session.temperature, session.max_tokens = settings["temperature"], settings["max_tokens"]
        session.backend = LocalServer(server, self._http)
        pane.ask(prompt)
        try:
            async for piece in session.stream(prompt):
                pane.add(piece)
        except ServerFailed as exc:
            pane.finish(error=str(exc))
            # A lost connection is a server dying (or dead): say why, start anew next time. An
            # error answer comes from a live server, which keeps running.
            exited = await server.wait_exit(STOP_WAIT_S if exc.lost else 0)
            if exited is not None and self.servers.get(pane_id) is server:
                del self.servers[pane_id]
                self._state(pane_id, f"error: {server.exit_message(exited)}")
                self._reap([server])
            return
        pane.finish()

    def action_reset(self) -> None:
        """Forget the conversations (the servers keep running)."""
        for pane_id in PANES:
            self.query_one(f"#{pane_id}", ChatPane).reset()

    def action_blur(self) -> None:
        """Leave the field, so that number keys switch screens again."""
        self.set_focus(None)

    def _error(self, exc: HomelabError) -> None:
        self.post_message(UserError(exc))
