"""A live chart: a multi-line sparkline under a title that shows the latest value and range."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline


class Chart(Vertical):
    """A bordered sparkline of one series (tokens/s, loss) with its latest, min and max."""

    DEFAULT_CSS = """
    Chart { border: round $primary 50%; height: 5; padding: 0 1; }
    Chart > Sparkline { height: 1fr; }
    """

    def __init__(
        self,
        label: str,
        fmt: str = "{:,.0f}",
        summary: Callable[[Sequence[float]], float] = statistics.fmean,
        *,
        id: str | None = None,
    ) -> None:
        super().__init__(id=id)
        self.label = label
        self.fmt = fmt
        self._summary = summary
        self.values: list[float] = []
        self.border_title = label

    def compose(self) -> ComposeResult:
        yield Sparkline([], summary_function=self._summary)

    def set_values(self, values: Sequence[float], note: str = "") -> None:
        """Show a new series; the title gives the latest value (then ``note``) and the range."""
        self.values = list(values)
        self.query_one(Sparkline).data = self.values
        if self.values:
            last = self.fmt.format(self.values[-1])
            low, high = self.fmt.format(min(self.values)), self.fmt.format(max(self.values))
            self.border_title = f"{self.label} {last}  {note}".rstrip()
            self.border_subtitle = f"{low} – {high}"
        else:
            self.border_title = f"{self.label} -  {note}".rstrip()
            self.border_subtitle = ""
