"""The Textual app: six screens on the number keys, one run followed in the background.

Screens are Textual modes, so each keeps its state while another is shown. The app builds
each with what it reads (the session, the controller, the followed run); screens ask the app
for what concerns it as a whole by posting messages (`homelab_dp.tui.messages`): follow a run,
show a user error. A thread worker follows the chosen run (`homelab_dp.app.follow`) and posts
`RunUpdated` messages that coalesce, so a burst of events never queues up more than one
repaint. Quitting only stops following: runs belong to their own process trees and go on.
"""

from __future__ import annotations

from pathlib import Path

from textual import work
from textual.app import App
from textual.binding import Binding
from textual.worker import get_current_worker

from homelab_dp.app.follow import Following, RunPoller, Snapshot
from homelab_dp.app.presets import preset_names
from homelab_dp.app.runs import RunController, make_controller
from homelab_dp.errors import HomelabError
from homelab_dp.render.errors import error_text
from homelab_dp.tui.messages import FollowRun, RunUpdated, UserError
from homelab_dp.tui.screens.chat import ChatScreen
from homelab_dp.tui.screens.hardware import HardwareScreen
from homelab_dp.tui.screens.launch import LaunchScreen
from homelab_dp.tui.screens.monitor import MonitorScreen
from homelab_dp.tui.screens.plan import PlanScreen
from homelab_dp.tui.screens.runs import RunsScreen
from homelab_dp.tui.session import DEFAULT_PRESET, Session

FOLLOW_INTERVAL_S = 0.25


class HomelabApp(App[None]):
    """homelab-dp's TUI: Hardware, Plan, Launch, Monitor, Runs and Chat."""

    CSS_PATH = "tui_app.tcss"
    TITLE = "homelab-dp"
    ENABLE_COMMAND_PALETTE = False  # its footer entry would not fit at 80 columns
    BINDINGS = [
        Binding("1", "switch_mode('hardware')", "Hardware"),
        Binding("2", "switch_mode('plan')", "Plan"),
        Binding("3", "switch_mode('launch')", "Launch"),
        Binding("4", "switch_mode('monitor')", "Monitor"),
        Binding("5", "switch_mode('runs')", "Runs"),
        Binding("6", "switch_mode('chat')", "Chat"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(
        self,
        controller: RunController | None = None,
        *,
        mode: str = "hardware",
        preset: str | None = None,
        follow: str | None = None,
        follow_interval: float = FOLLOW_INTERVAL_S,
    ) -> None:
        """``follow``: the run to follow from the start; ``follow_interval``: seconds between
        two polls of the followed run's files."""
        super().__init__()
        self.controller = controller or make_controller()
        self.session = Session()
        self.following = Following()
        self.start_mode = mode
        self.follow_interval = follow_interval
        self.updates_handled = 0
        """RunUpdated messages handled (fewer than posted when they coalesce)."""
        self._initial_preset = preset
        self._initial_follow = follow
        # The modes (built on first show), each given what it reads.
        self.add_mode("hardware", HardwareScreen)
        self.add_mode("plan", lambda: PlanScreen(self.session))
        self.add_mode("launch", lambda: LaunchScreen(self.session, self.controller))
        self.add_mode("monitor", lambda: MonitorScreen(self.controller, self.following))
        self.add_mode("runs", lambda: RunsScreen(self.controller))
        self.add_mode("chat", lambda: ChatScreen(self.controller, self.following))

    @property
    def followed(self) -> str | None:
        """The id of the run the Monitor shows."""
        return self.following.run_id

    @property
    def snapshot(self) -> Snapshot | None:
        """The latest state of the followed run."""
        return self.following.snapshot

    def on_mount(self) -> None:
        """Load the first preset, start following a run if asked, show the first screen."""
        names = preset_names()
        name = self._initial_preset or (DEFAULT_PRESET if DEFAULT_PRESET in names else None)
        name = name or (names[0] if names else None)
        if name:
            try:
                self.session.load(name)
            except HomelabError as exc:
                self.show_error(exc)
        if self._initial_follow:
            self.follow(self._initial_follow)
        self.switch_mode(self.start_mode)

    # ------------------------------------------------------------------ errors
    def show_error(self, exc: HomelabError) -> None:
        """A user error as a notification, worded as the CLI words it."""
        self.notify(error_text(exc), severity="error", timeout=10, markup=False)

    def on_user_error(self, message: UserError) -> None:
        self.show_error(message.error)

    # ------------------------------------------------------------------ following a run
    def follow(self, run_id: str) -> bool:
        """Follow a run in the Monitor (stops following the previous one, never the run)."""
        try:
            run_dir = self.controller.run_dir(run_id)
        except HomelabError as exc:
            self.show_error(exc)
            return False
        self.following.run_id = run_dir.name
        self.following.snapshot = None
        self._follow_worker(run_dir.name)
        if isinstance(self.screen, MonitorScreen):
            self.screen.show(None)
        return True

    def on_follow_run(self, message: FollowRun) -> None:
        """A screen chose a run: follow it and show the Monitor."""
        if self.follow(message.run_id):
            self.switch_mode("monitor")

    @work(thread=True, exclusive=True, group="follow", exit_on_error=False)
    def _follow_worker(self, run_id: str) -> None:
        """Poll the run's files and post a snapshot whenever something changed."""
        worker = get_current_worker()
        try:
            poller = RunPoller(self.controller, run_id)
            while not worker.is_cancelled:
                snapshot = poller.poll()
                if snapshot is not None:
                    self.post_message(RunUpdated(snapshot))
                worker.cancelled_event.wait(self.follow_interval)
        except HomelabError as exc:  # the run folder vanished while we followed it
            self.call_from_thread(self.show_error, exc)

    def on_run_updated(self, message: RunUpdated) -> None:
        """Keep the newest snapshot; repaint the Monitor only while it is the screen shown."""
        if message.snapshot.run_id != self.following.run_id:
            return  # from the previous run's poller, posted before it was cancelled
        self.updates_handled += 1
        self.following.snapshot = message.snapshot
        if isinstance(self.screen, MonitorScreen):
            self.screen.show(message.snapshot)


def run_tui(root: Path | None = None) -> int:
    """Run the TUI until the user quits; running runs go on. Returns the exit code."""
    HomelabApp(make_controller(root)).run()
    return 0
