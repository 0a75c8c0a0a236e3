"""Screen 1, Hardware: the probe — a card per GPU, the links between them, the CPU host — and
below it the readiness checks of `homelab-dp doctor`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Static
from textual.worker import get_current_worker

from homelab_dp.app import doctor
from homelab_dp.app.probe import HardwareReport, probe_machine
from homelab_dp.render.doctor import checks_panel
from homelab_dp.render.probe import (
    gpu_card,
    gpu_title,
    host_text,
    summary_text,
    topology_text,
)

CHECKS_NOTE = "The checks of `homelab-dp doctor`; r runs them again."


class HardwareScreen(Screen[None]):
    """What the machine has, probed through NVML (or a recording in tests and demos)."""

    BINDINGS = [Binding("r", "refresh", "Refresh")]
    AUTO_FOCUS = "#hw-body"

    def __init__(self) -> None:
        super().__init__()
        self.report: HardwareReport | None = None
        self.checks: list[doctor.Check] | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with VerticalScroll(id="hw-body"):
            yield Static("probing…", id="hw-summary")
            yield Static(id="hw-notice", classes="notice")
            yield Grid(id="gpu-cards")
            yield Static(id="topology", classes="panel")
            yield Static(id="host", classes="panel")
            # One screenful, scrolling inside below a fixed first line: whatever the checks
            # say and whenever they arrive, nothing above them moves.
            with Vertical(id="hw-checks", classes="panel"):
                yield Static(CHECKS_NOTE, id="hw-checks-note")
                with VerticalScroll(id="hw-checks-scroll"):
                    yield Static(id="hw-checks-text")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "1 Hardware"
        self.query_one("#topology").border_title = "between cards"
        self.query_one("#host").border_title = "host"
        self.query_one("#hw-checks").border_title = "readiness · homelab-dp doctor"
        self.action_refresh()

    def action_refresh(self) -> None:
        """Probe and check again, off the UI thread: NVML can take a moment on a busy driver,
        and the checks import torch and bitsandbytes (seconds, the first time)."""
        self.query_one("#hw-summary", Static).update("probing…")
        self.query_one("#hw-checks-text", Static).update(
            "checking the driver, torch, NCCL, bitsandbytes, disk and limits…"
        )
        self._probe()

    @work(thread=True, exclusive=True, group="probe")
    def _probe(self) -> None:
        report = probe_machine()
        if not self._deliver(self.show, report):
            return
        checks = doctor.run_checks(doctor.gather(report))
        self._deliver(self.show_checks, checks)

    def _deliver(self, show: Callable[[Any], Any], value: Any) -> bool:
        """Hand a result to the UI thread; False when a refresh replaced this work or the app
        has gone meanwhile."""
        if get_current_worker().is_cancelled:
            return False
        try:
            self.app.call_from_thread(show, value)
        except RuntimeError:  # the app closed while this thread worked
            return False
        return True

    async def show(self, report: HardwareReport) -> None:
        """Fill the screen from a probe report."""
        self.report = report
        self.query_one("#hw-summary", Static).update(summary_text(report))
        notice = self.query_one("#hw-notice", Static)
        notice.update(report.notice or "")
        notice.display = bool(report.notice)
        cards = self.query_one("#gpu-cards", Grid)
        await cards.remove_children()
        widgets = []
        for g in report.gpus:
            card = Static(gpu_card(g), classes="gpu-card panel")
            card.border_title = gpu_title(g)
            widgets.append(card)
        await cards.mount_all(widgets)
        cards.display = bool(report.gpus)
        topology = self.query_one("#topology", Static)
        topology.update(topology_text(report))
        topology.display = bool(report.gpus)
        self.query_one("#host", Static).update(host_text(report.host))

    def show_checks(self, checks: list[doctor.Check]) -> None:
        """Fill the readiness panel (the same checks as `homelab-dp doctor`)."""
        self.checks = checks
        self.query_one("#hw-checks-text", Static).update(checks_panel(checks))
