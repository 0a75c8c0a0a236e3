"""Screen 5, Runs: every run the controller knows (the per-user run index, the runs folder and
./runs: the same list as `homelab-dp runs`); follow one, resume a stopped one, export a result
(`e`: the dialog in `export_dialog`, then `homelab-dp export` in a child process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static

from homelab_dp.app.export import export_in_child
from homelab_dp.app.runs import RunController
from homelab_dp.errors import HomelabError
from homelab_dp.render.export import export_lines
from homelab_dp.render.runs import row_cells
from homelab_dp.tui.messages import FollowRun, UserError
from homelab_dp.tui.screens.export_dialog import ExportDialog

REFRESH_S = 3.0
COLUMNS = ("status", "steps", "loss", "energy", "time", "run")


def cell_width(cell: Text | str) -> int:
    """Terminal cells a table cell takes."""
    return (cell if isinstance(cell, Text) else Text(cell)).cell_len


class RunsScreen(Screen[None]):
    """The run history, newest first, refreshed every few seconds; a run whose folder has gone
    is a row that says so (following or resuming it shows why not)."""

    BINDINGS = [
        Binding("enter", "follow", "Follow", show=False),
        Binding("r", "refresh", "Refresh"),
        Binding("R", "resume", "Resume"),
        Binding("e", "export", "Export"),
    ]
    AUTO_FOCUS = "#runs"

    def __init__(self, controller: RunController) -> None:
        super().__init__()
        self.controller = controller
        self.runs: list[dict[str, Any]] = []

    def compose(self) -> ComposeResult:
        yield Header()
        yield DataTable(id="runs", cursor_type="row", zebra_stripes=True)
        yield Static(
            "enter: follow in 4 Monitor · R: resume a stopped or failed run · e: export",
            id="runs-help",
        )
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "5 Runs"
        self.action_refresh()
        self.set_interval(REFRESH_S, self._refresh_if_shown)

    def on_screen_resume(self) -> None:
        if self.is_mounted:
            self.action_refresh()

    def _refresh_if_shown(self) -> None:
        if self.app.screen is self:  # hidden screens need no reading of every run's files
            self.action_refresh()

    def action_refresh(self) -> None:
        """Re-read the runs folder (off the UI thread: it folds every run's events)."""
        self._load()

    @work(thread=True, exclusive=True, group="runs", exit_on_error=False)
    def _load(self) -> None:
        runs = self.controller.list_runs()
        self.app.call_from_thread(self.show, runs)

    def show(self, runs: list[dict[str, Any]]) -> None:
        """Fill the table, keeping the cursor on the same run. Nothing changed since the last
        read (the periodic refresh, mostly): the table is left as it is, not rebuilt."""
        if runs == self.runs and self.runs:
            return
        table = self.query_one(DataTable)
        selected = self.selected()
        self.runs = runs
        rows = [row_cells(run) for run in runs]
        # Columns as wide as their widest cell, set here: left to DataTable, the widths are
        # measured only when its queue runs empty, and a frame drawn before that stays cached
        # with every column as narrow as its header (seen under load).
        table.clear(columns=True)
        for index, name in enumerate(COLUMNS):
            width = max([len(name), *(cell_width(row[index]) for row in rows)])
            table.add_column(name, key=name, width=width)
        for run, cells in zip(runs, rows, strict=True):
            table.add_row(*cells, key=run.get("path") or run["run_id"])  # ids may repeat
        ids = [r["run_id"] for r in runs]
        if selected in ids:
            table.move_cursor(row=ids.index(selected))
        if not runs:
            root = self.controller.root
            self.query_one("#runs-help", Static).update(
                Text(
                    f"No runs yet (new runs go to {root}): start one on 3 Launch or with "
                    "`homelab-dp run`."
                )
            )

    def selected(self) -> str | None:
        """The id of the run under the cursor."""
        row = self._selected_row()
        return None if row is None else row["run_id"]

    @on(DataTable.RowSelected)
    def action_follow(self) -> None:
        """Follow the selected run on the Monitor screen."""
        run_id = self.selected()
        if run_id:
            self.post_message(FollowRun(run_id))

    def action_resume(self) -> None:
        """Resume the selected run from its newest complete checkpoint, then follow it."""
        run_id = self.selected()
        if run_id is None:
            return
        try:
            resumed = self.controller.resume(run_id)
        except HomelabError as exc:
            self.post_message(UserError(exc))
            return
        self.app.notify(f"resuming {resumed}")
        self.post_message(FollowRun(resumed))

    def action_export(self) -> None:
        """Ask for a format and a folder, then export the selected run's result."""
        row = self._selected_row()
        if row is None:
            return
        run_id, where = row["run_id"], row.get("path") or row["run_id"]

        def chosen(answer: tuple[str, Path] | None) -> None:
            if answer is not None:
                fmt, out = answer
                self.app.notify(f"exporting {run_id} as {fmt} to {out}")
                self._export(where, fmt, out)

        self.app.push_screen(ExportDialog(run_id), chosen)

    def _selected_row(self) -> dict[str, Any] | None:
        table = self.query_one(DataTable)
        if not self.runs or table.cursor_row < 0 or table.cursor_row >= len(self.runs):
            return None
        return self.runs[table.cursor_row]

    @work(thread=True, group="export", exit_on_error=False)
    def _export(self, run: str, fmt: str, out: Path) -> None:
        """The export in a child process (torch, the merge), waited for off the UI thread."""
        try:
            result = export_in_child(run, fmt, out)
        except HomelabError as exc:
            self.post_message(UserError(exc))
            return
        self.app.call_from_thread(self.app.notify, "\n".join(export_lines(result.to_json())))
