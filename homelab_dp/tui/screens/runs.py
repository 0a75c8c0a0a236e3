"""Screen 5, Runs: every run the controller knows (the per-user run index, the runs folder and
./runs: the same list as `homelab-dp runs`); follow one, resume a stopped one, export a result
(`e`: the dialog in `export_dialog`, then `homelab-dp export` in a child process); mark runs
(space) and compare them (`c`), or compare the selected run's sweep (`s`): `app.compare`, the
function behind `homelab-dp runs compare`, shown by `CompareScreen`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static

from homelab_dp.app.compare import compare
from homelab_dp.app.export import export_in_child
from homelab_dp.app.runs import RunController
from homelab_dp.errors import HomelabError
from homelab_dp.render.export import export_lines
from homelab_dp.render.runs import row_cells
from homelab_dp.tui.messages import FollowRun, UserError
from homelab_dp.tui.screens.export_dialog import ExportDialog
from homelab_dp.tui.widgets.run_compare import CompareView

REFRESH_S = 3.0
COLUMNS = ("status", "steps", "loss", "energy", "time", "run")
MARK = "●"
"""The row label of a run marked for comparison (the other rows: a blank while any is marked)."""
HELP = (
    "enter: follow in 4 Monitor · R: resume a stopped or failed run · e: export\n"
    "space: mark · c: compare the marked runs · s: compare the selected run's sweep"
)


def cell_width(cell: Text | str) -> int:
    """Terminal cells a table cell takes."""
    return (cell if isinstance(cell, Text) else Text(cell)).cell_len


def row_key(run: dict[str, Any]) -> str:
    """A run's row: its folder (ids may repeat across runs folders), else its id."""
    return run.get("path") or run["run_id"]


class CompareScreen(Screen[None]):
    """Runs side by side (`runs compare`'s document); escape goes back to the Runs list."""

    BINDINGS = [Binding("escape", "back", "Back")]
    AUTO_FOCUS = "#compare-table"

    def __init__(self, doc: dict[str, Any]) -> None:
        super().__init__()
        self.doc = doc

    def compose(self) -> ComposeResult:
        yield Header()
        yield CompareView(self.doc, id="compare")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "5 Runs · compare"

    def action_back(self) -> None:
        """Back to the Runs list (the marks are kept)."""
        self.dismiss(None)


class RunsScreen(Screen[None]):
    """The run history, newest first, refreshed every few seconds; a run whose folder has gone
    is a row that says so (following or resuming it shows why not)."""

    BINDINGS = [
        Binding("enter", "follow", "Follow", show=False),
        Binding("r", "refresh", "Refresh"),
        Binding("R", "resume", "Resume"),
        Binding("e", "export", "Export"),
        Binding("space", "mark", "Mark"),
        Binding("c", "compare", "Compare"),
        Binding("s", "compare_sweep", "Sweep"),
    ]
    AUTO_FOCUS = "#runs"

    def __init__(self, controller: RunController) -> None:
        super().__init__()
        self.controller = controller
        self.runs: list[dict[str, Any]] = []
        self.marked: set[str] = set()
        """The rows (`row_key`) marked for comparison."""

    def compose(self) -> ComposeResult:
        yield Header()
        yield DataTable(id="runs", cursor_type="row", zebra_stripes=True)
        yield Static(HELP, id="runs-help")
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
        self._fill(runs)
        if not runs:
            root = self.controller.root
            self.query_one("#runs-help", Static).update(
                Text(
                    f"No runs yet (new runs go to {root}): start one on 3 Launch or with "
                    "`homelab-dp run`."
                )
            )

    def _fill(self, runs: list[dict[str, Any]]) -> None:
        """Rebuild the table from ``runs``, marks as row labels, the cursor on the same run;
        marks of runs no longer listed are dropped."""
        table = self.query_one(DataTable)
        row = self._selected_row()
        selected = None if row is None else row_key(row)
        self.runs = runs
        keys = [row_key(run) for run in runs]
        self.marked &= set(keys)
        rows = [row_cells(run) for run in runs]
        # Columns as wide as their widest cell, set here: left to DataTable, the widths are
        # measured only when its queue runs empty, and a frame drawn before that stays cached
        # with every column as narrow as its header (seen under load).
        table.clear(columns=True)
        for index, name in enumerate(COLUMNS):
            width = max([len(name), *(cell_width(row[index]) for row in rows)])
            table.add_column(name, key=name, width=width)
        # The label column only while a run is marked: DataTable measures labels when idle,
        # and a frame drawn before that (under load) lacked a column the next one had.
        for key, cells in zip(keys, rows, strict=True):
            label = (MARK if key in self.marked else " ") if self.marked else None
            table.add_row(*cells, key=key, label=label)
        if selected in keys:
            table.move_cursor(row=keys.index(selected))

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

    def action_mark(self) -> None:
        """Mark the selected run for comparison, or unmark it; the cursor moves to the next
        row, so marking several is pressing space several times."""
        row = self._selected_row()
        if row is None:
            return
        key = row_key(row)
        self.marked ^= {key}
        self._fill(self.runs)
        self.query_one(DataTable).action_cursor_down()

    def marked_ids(self) -> list[str]:
        """The ids of the marked runs, in the table's order."""
        return [run["run_id"] for run in self.runs if row_key(run) in self.marked]

    def action_compare(self) -> None:
        """Compare the marked runs (at least two) on a screen of their own."""
        refs = [row_key(run) for run in self.runs if row_key(run) in self.marked]
        if len(refs) < 2:
            self.post_message(
                UserError(
                    HomelabError(
                        f"compare: {len(refs)} run(s) marked; mark at least two",
                        hint="space marks the selected run (again: unmarks); "
                        "s compares the selected run's sweep",
                    )
                )
            )
            return
        self._compare(refs, None)

    def action_compare_sweep(self) -> None:
        """Compare every run of the selected run's sweep."""
        row = self._selected_row()
        if row is None:
            return
        sweep = row.get("sweep_id")
        if not sweep:
            self.post_message(
                UserError(
                    HomelabError(
                        f"run {row['run_id']} is not part of a sweep",
                        hint="mark runs with space, then press c to compare them",
                    )
                )
            )
            return
        self._compare([], sweep)

    @work(thread=True, exclusive=True, group="compare", exit_on_error=False)
    def _compare(self, refs: list[str], sweep: str | None) -> None:
        """`app.compare` (it reads every run's events) off the UI thread, then its screen."""
        try:
            doc = compare(self.controller, refs, sweep=sweep)
        except HomelabError as exc:
            self.post_message(UserError(exc))
            return
        self.app.call_from_thread(self._open_compare, doc)

    def _open_compare(self, doc: dict[str, Any]) -> None:
        self.app.push_screen(CompareScreen(doc))

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
