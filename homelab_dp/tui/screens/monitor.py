"""Screen 4, Monitor: the followed run live — charts (tokens/s, loss, eval loss when the run
evaluates; under them, for a preference run, reward accuracy and margin, or ORPO's nll and log
odds), accumulation, speed (measured scaling, the communication share, predicted against
measured), devices, stragglers, samples (the latest answers beside their prompts; s steps back
through earlier ones), GRPO's latest completions with their rewards (from ``rollouts/``), log."""

from __future__ import annotations

import statistics

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Log, Static

from homelab_dp.app.follow import Following, RunView, Snapshot, is_live
from homelab_dp.app.runs import RunController
from homelab_dp.errors import HomelabError
from homelab_dp.render.run_view import (
    accum_text,
    devices_text,
    head_text,
    rollouts_text,
    sample_steps,
    samples_text,
    speed_text,
    stragglers_text,
)
from homelab_dp.render.text import mfu_text
from homelab_dp.tui.messages import UserError
from homelab_dp.tui.screens.confirm import ConfirmScreen
from homelab_dp.tui.widgets.chart import Chart

NOTHING = (
    "No run followed yet.\n\nStart one on 3 Launch, or choose one on 5 Runs "
    "(runs started from the CLI or over SSH are there too)."
)


OBJECTIVE_CHARTS = (
    ("reward_accuracy", "reward accuracy", "{:.3f}"),
    ("reward_margin", "reward margin", "{:.3f}"),
    ("nll", "nll", "{:.4f}"),
    ("log_odds_ratio", "log odds", "{:.3f}"),
    ("reward", "reward", "{:.3f}"),
    ("completion_length", "completion length", "{:.1f}"),
)
"""A preference or GRPO run's charts: (figure, title, format); each shown once a step gave it."""


def chart_id(figure: str) -> str:
    """The id of a preference figure's chart: ``chart-reward_accuracy``…"""
    return f"chart-{figure}"


class MonitorScreen(Screen[None]):
    """Shows the latest snapshot of the followed run; repaints only while visible."""

    DEFAULT_CSS = """
    #objective-charts { height: 5; }
    #objective-charts > Chart { width: 1fr; height: 5; }
    #speed { padding: 0 1; height: auto; }
    """

    BINDINGS = [Binding("x", "stop", "Stop run"), Binding("s", "earlier_samples", "Samples")]

    def __init__(self, controller: RunController, following: Following) -> None:
        super().__init__()
        self.controller = controller
        self.following = following
        self.shown: Snapshot | None = None
        self._log_seq = 0
        self._log_run: str | None = None
        self.samples_back = 0
        """How many sampled steps before the latest the samples panel shows (key s)."""

    def compose(self) -> ComposeResult:
        yield Header()
        with VerticalScroll(id="mon-body"):
            yield Static(NOTHING, id="mon-head")
            with Horizontal(id="charts"):
                yield Chart("tokens/s", "{:,.0f}", max, id="chart-tps")
                yield Chart("loss", "{:.3f}", statistics.fmean, id="chart-loss")
                # Validation while training: shown once the run has written an eval event.
                yield Chart("eval loss", "{:.3f}", statistics.fmean, id="chart-eval")
            # Beside the loss of a preference run: what the objective is learning.
            with Horizontal(id="objective-charts"):
                for figure, title, fmt in OBJECTIVE_CHARTS:
                    yield Chart(title, fmt, statistics.fmean, id=chart_id(figure))
            yield Static(id="accum")
            yield Static(id="speed")
            yield Static(id="devices", classes="panel")
            yield Static(id="stragglers")
            yield Static(id="samples", classes="panel")
            yield Static(id="rollouts", classes="panel")
            yield Log(id="log", max_lines=500, auto_scroll=True)
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "4 Monitor"
        self.query_one("#devices").border_title = "devices"
        self.query_one("#log").border_title = "log"
        self.query_one("#samples").border_title = "samples"
        self.query_one("#rollouts").border_title = "completions"
        self.show(self.following.snapshot)

    def on_screen_resume(self) -> None:
        snapshot = self.following.snapshot
        if self.is_mounted and snapshot is not self.shown:
            self.show(snapshot)

    def show(self, snapshot: Snapshot | None) -> None:
        """Repaint every panel from one snapshot (None: nothing followed yet)."""
        self.shown = snapshot
        parts = ("#charts", "#objective-charts", "#accum", "#speed", "#devices", "#stragglers",
                 "#samples", "#rollouts", "#log")  # fmt: skip
        for selector in parts:
            self.query_one(selector).display = snapshot is not None
        head = self.query_one("#mon-head", Static)
        if snapshot is None:
            followed = self.following.run_id
            head.update(f"loading {followed}…" if followed else NOTHING)
            return
        view = snapshot.view
        head.update(head_text(view))
        tps = [v for _, v in view.tokens_per_s_history]
        self.query_one("#chart-tps", Chart).set_values(tps, note=mfu_text(view.mfu))
        self.query_one("#chart-loss", Chart).set_values([v for _, v in view.losses])
        evals = self.query_one("#chart-eval", Chart)
        evals.display = bool(view.evals)
        best = view.best_eval
        note = f"best {best.loss:.3f} @ {best.step}" if best and best.loss is not None else ""
        evals.set_values([float(e.loss) for e in view.evals if e.loss is not None], note=note)
        self._show_objective(view)
        self.query_one("#accum", Static).update(accum_text(view))
        speed, text = self.query_one("#speed", Static), speed_text(view)
        speed.update(text)
        speed.display = bool(text.plain)  # one process and no prediction: nothing to say
        self.query_one("#devices", Static).update(devices_text(view))
        stragglers = self.query_one("#stragglers", Static)
        stragglers.update(stragglers_text(view))
        stragglers.display = bool(view.stragglers)
        self._show_samples()
        rollouts = self.query_one("#rollouts", Static)
        rollouts.display = snapshot.rollouts is not None and bool(snapshot.rollouts.rows)
        rollouts.update(rollouts_text(snapshot.rollouts))
        self._show_log(snapshot)

    def _show_objective(self, view: RunView) -> None:
        """The preference figures' charts, each with the latest eval's value: only those the
        run's steps gave (none for SFT)."""
        last_eval = view.last_eval
        for figure, _, fmt in OBJECTIVE_CHARTS:
            chart = self.query_one(f"#{chart_id(figure)}", Chart)
            values = view.series(figure)
            chart.display = bool(values)
            at_eval = getattr(last_eval, figure, None) if last_eval is not None else None
            chart.set_values(
                values, note=f"eval {fmt.format(at_eval)}" if at_eval is not None else ""
            )
        self.query_one("#objective-charts").display = bool(view.figures)

    def _show_samples(self) -> None:
        panel = self.query_one("#samples", Static)
        view = self.shown.view if self.shown is not None else None
        panel.display = view is not None and bool(view.samples)
        if view is not None:
            panel.update(samples_text(view, self.samples_back))

    def action_earlier_samples(self) -> None:
        """Show the samples of the sampled step before the one shown (after the oldest: the
        latest again)."""
        view = self.shown.view if self.shown is not None else None
        steps = len(sample_steps(view)) if view is not None else 0
        self.samples_back = (self.samples_back + 1) % steps if steps else 0
        self._show_samples()

    def _show_log(self, snapshot: Snapshot) -> None:
        log = self.query_one("#log", Log)
        if snapshot.log_files:
            log.border_title = "logs: " + ", ".join(snapshot.log_files)
        new = snapshot.log_seq - self._log_seq
        if snapshot.run_id != self._log_run or new > len(snapshot.log_lines) or new < 0:
            log.clear()  # another run, or more new lines than the snapshot keeps
            new = len(snapshot.log_lines)
        if new:
            log.write_lines(snapshot.log_lines[-new:])
        self._log_run = snapshot.run_id
        self._log_seq = snapshot.log_seq

    # ------------------------------------------------------------------ stopping
    def action_stop(self) -> None:
        """Ask, then stop the run gracefully (all ranks agree, checkpoint, exit)."""
        snapshot = self.shown
        if snapshot is None:
            self.app.notify("no run followed", severity="warning")
            return
        if not is_live(snapshot.view.status):
            self.app.notify(f"run {snapshot.run_id} is {snapshot.view.status}: nothing to stop")
            return
        run_id = snapshot.run_id

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.app.notify(f"stopping {run_id}: the ranks checkpoint, then exit")
                self._stop(run_id)

        self.app.push_screen(
            ConfirmScreen(f"Stop run {run_id}?\nIt saves a checkpoint; resume it from 5 Runs."),
            confirmed,
        )

    @work(thread=True, group="stop", exit_on_error=False)
    def _stop(self, run_id: str) -> None:
        try:
            state = self.controller.stop(run_id)
        except HomelabError as exc:
            self.post_message(UserError(exc))
            return
        self.app.call_from_thread(self.app.notify, f"run {run_id}: {state.get('status')}")
