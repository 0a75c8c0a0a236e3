"""Screen 3, Launch: start the chosen plan in the background, or save it as a preset."""

from __future__ import annotations

import shlex

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Checkbox, Footer, Header, Input, Label, Static
from textual.worker import Worker, WorkerState, get_current_worker

from homelab_dp.app.presets import save_preset
from homelab_dp.app.runs import RunController
from homelab_dp.errors import HomelabError
from homelab_dp.render.errors import error_lines, error_text
from homelab_dp.render.plan import PLAIN
from homelab_dp.tui.messages import FollowRun, UserError
from homelab_dp.tui.session import Session


class LaunchScreen(Screen[None]):
    """What will run, the equivalent command, Start; and Save as a named preset."""

    BINDINGS = [
        Binding("s", "start", "Start"),
        Binding("u", "queue", "Queue", show=False),  # the Queue button shows it; the footer is full
        Binding("w", "save", "Save"),
        Binding("a", "auto_fit", "Auto-fit", show=False),  # the checkbox shows it
        Binding("escape", "blur", "Leave field", show=False),
    ]
    AUTO_FOCUS = "#start"

    def __init__(self, session: Session, controller: RunController) -> None:
        super().__init__()
        self.session = session
        self.controller = controller
        self.launching = False
        self.started: str | None = None
        """The id of the run this screen started last."""
        self.queueing = False
        """Whether the launch being prepared queues its run (Queue) or starts it (Start)."""

    def compose(self) -> ComposeResult:
        yield Header()
        with VerticalScroll(id="launch-body"):
            yield Static(id="launch-summary", classes="panel")
            with Horizontal(classes="row"):
                yield Label("--set")
                yield Input(
                    placeholder="train.max_steps=20 train.lr=1e-4 …", id="extra", compact=True
                )
            yield Static(id="launch-command")
            with Horizontal(classes="buttons"):
                yield Button("Start run", id="start", variant="success", compact=True)
                yield Button("Queue", id="queue", compact=True)
                yield Checkbox("--force (start anyway)", id="force", compact=True)
                yield Checkbox("--auto-fit", id="auto-fit", compact=True)
            yield Static(id="launch-status")
            yield Label("Save these settings as a preset", classes="section")
            with Horizontal(classes="row"):
                yield Label("name")
                yield Input(placeholder="my-finetune", id="save-name", compact=True)
            with Horizontal(classes="buttons"):
                yield Button("Save preset", id="save", compact=True)
                yield Checkbox("overwrite (--force)", id="overwrite", compact=True)
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "3 Launch"
        self.query_one("#launch-summary").border_title = "what will run"
        self.refresh_summary()

    def on_screen_resume(self) -> None:
        if self.is_mounted:
            self.refresh_summary()

    # ------------------------------------------------------------------ showing
    def refresh_summary(self) -> None:
        """Show the preset, the overrides, the last plan and the equivalent CLI command."""
        s = self.session
        out = Text()
        out.append("preset ").append(s.preset_name or "(none)", style="bold")
        if s.gpus:
            out.append(f"  --gpus {s.gpus}")
        overrides = s.overrides()
        out.append("\nchanged: " + (", ".join(overrides) if overrides else "nothing"))
        planned = s.planned
        if planned is None and s.preset_name:
            try:
                planned = s.plan()
            except HomelabError as exc:
                out.append("\n" + error_text(exc), style="red")
        if planned is not None:
            p = planned.plan
            out.append("\nplan: ")
            out.append("fits" if p.fits else "does not fit", style="green" if p.fits else "red")
            out.append(
                f" · {PLAIN[p.chosen.method]} · {p.chosen.distribution} · {planned.hardware.kind}"
                f" × {p.world_size} · effective batch {p.effective_batch} · lr {p.lr.applied:.3g}"
            )
        self.query_one("#launch-summary", Static).update(out)
        command = s.command() + (" --auto-fit" if self._auto_fit() else "")
        self.query_one("#launch-command", Static).update(Text(command, style="bright_black"))

    def _auto_fit(self) -> bool:
        return self.query_one("#auto-fit", Checkbox).value

    def action_auto_fit(self) -> None:
        """Auto-fit on or off: the largest micro-batch that fits, and the retry after
        out-of-memory (`run --auto-fit`, `app.plan.auto_fit_preset`)."""
        box = self.query_one("#auto-fit", Checkbox)
        box.value = not box.value

    @on(Checkbox.Changed, "#auto-fit")
    def _auto_fit_changed(self) -> None:
        self.refresh_summary()

    @on(Input.Changed, "#extra")
    def _extra_changed(self, event: Input.Changed) -> None:
        try:
            self.session.extra = shlex.split(event.value)
        except ValueError:  # an unfinished quote while typing
            return
        self.session.planned = None  # the overrides changed: the Plan screen re-plans on show
        self.refresh_summary()

    def _status(self, text: str, style: str = "") -> None:
        self.query_one("#launch-status", Static).update(Text(text, style=style))

    def action_blur(self) -> None:
        """Leave the field, so that the screen's keys work again."""
        self.set_focus(None)

    # ------------------------------------------------------------------ starting
    @on(Button.Pressed, "#start")
    def action_start(self) -> None:
        """Prepare (model, data, plan) and start the run, off the UI thread."""
        self._begin(queue=False)

    @on(Button.Pressed, "#queue")
    def action_queue(self) -> None:
        """Prepare, then queue the run: it starts by itself when its devices are free."""
        self._begin(queue=True)

    def _begin(self, queue: bool) -> None:
        if self.launching:
            self.app.notify("a run is already being prepared", severity="warning")
            return
        if not self.session.preset_name:
            self.app.notify(
                error_lines(["no preset chosen"], "choose one on 2 Plan"), severity="error"
            )
            return
        self.launching = True
        self._status("preparing: reading the model and the data, checking the plan…", "cyan")
        force = self.query_one("#force", Checkbox).value
        s = self.session
        self.queueing = queue
        self._launch(s.preset_name, s.overrides(), s.gpus or None, force, queue, self._auto_fit())

    @work(thread=True, exclusive=True, group="launch", exit_on_error=False)
    def _launch(
        self,
        preset: str,
        overrides: list[str],
        gpus: str | None,
        force: bool,
        queue: bool,
        auto_fit: bool,
    ) -> str:
        # --force also starts on devices another run is using; --queue waits for them instead.
        # --auto-fit: the largest micro-batch that fits, and the keeper's out-of-memory retry.
        chosen = {k: True for k, on in (("queue", queue), ("auto_fit", auto_fit)) if on}
        prepared = self.controller.prepare(
            preset, overrides=overrides, gpus=gpus, force=force, **chosen
        )
        if get_current_worker().is_cancelled:  # the TUI was closed while preparing
            raise RuntimeError("launch cancelled")
        fit = prepared.fit if auto_fit else None
        if fit is not None and fit.fits:
            self.app.call_from_thread(self.app.notify, fit.describe())
        for warning in prepared.warnings:
            self.app.call_from_thread(self.app.notify, warning, severity="warning")
        options = {k: True for k, on in (("queue", queue), ("force", force)) if on}
        options |= {"auto_fit": True} if auto_fit else {}
        return self.controller.start(prepared, **options)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """The launch thread ended: follow the new run, or show why it did not start."""
        if event.worker.group != "launch" or event.state not in (
            WorkerState.SUCCESS,
            WorkerState.ERROR,
        ):
            return
        self.launching = False
        if event.state == WorkerState.SUCCESS:
            run_id = str(event.worker.result)
            self.started = run_id
            verb = "queued" if self.queueing else "started"
            self._status(f"{verb} {run_id}", "green")
            self.app.notify(f"{verb} run {run_id}\nfollow it with: homelab-dp attach {run_id}")
            self.post_message(FollowRun(run_id))
            return
        error = event.worker.error
        if isinstance(error, HomelabError):
            self._status("not started", "red")
            self.post_message(UserError(error))
        else:
            self._status(f"not started: {error}", "red")
            text = error_lines([f"could not start the run: {error}"])
            self.app.notify(text, severity="error", markup=False)

    # ------------------------------------------------------------------ saving
    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        """Save the preset with the edits under the typed name (as `presets save` does)."""
        name = self.query_one("#save-name", Input).value.strip()
        force = self.query_one("#overwrite", Checkbox).value
        try:
            path = save_preset(name, self.session.open(), force=force)
        except HomelabError as exc:
            self.post_message(UserError(exc))
            return
        self._status(f"saved {path}", "green")
        self.app.notify(f"saved {path}\nrun it with: homelab-dp run {name}", markup=False)

    @on(Input.Submitted, "#save-name")
    def _save_submitted(self) -> None:
        self.action_save()
