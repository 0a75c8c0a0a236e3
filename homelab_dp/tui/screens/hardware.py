"""Screen 1, Hardware: the probe — a card per GPU, the links between them, the CPU host."""

from __future__ import annotations

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from homelab_dp.core.hardware import HardwareReport
from homelab_dp.probe import nvml
from homelab_dp.render.probe import (
    gpu_card,
    gpu_title,
    host_text,
    summary_text,
    topology_text,
)


class HardwareScreen(Screen[None]):
    """What the machine has, probed through NVML (or a recording in tests and demos)."""

    BINDINGS = [Binding("r", "refresh", "Refresh")]
    AUTO_FOCUS = "#hw-body"

    def __init__(self) -> None:
        super().__init__()
        self.report: HardwareReport | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with VerticalScroll(id="hw-body"):
            yield Static("probing…", id="hw-summary")
            yield Static(id="hw-notice", classes="notice")
            yield Grid(id="gpu-cards")
            yield Static(id="topology", classes="panel")
            yield Static(id="host", classes="panel")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "1 Hardware"
        self.query_one("#topology").border_title = "between cards"
        self.query_one("#host").border_title = "host"
        self.action_refresh()

    def action_refresh(self) -> None:
        """Probe again (NVML can take a moment on a busy driver, so off the UI thread)."""
        self.query_one("#hw-summary", Static).update("probing…")
        self._probe()

    @work(thread=True, exclusive=True, group="probe")
    def _probe(self) -> None:
        report = nvml.probe()
        self.app.call_from_thread(self.show, report)

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
