"""Screen 5, Runs: marking runs (space), comparing them (`c`) or the selected run's sweep (`s`)
on recorded run folders (no launch): the table `app.compare` ranks, the last sample of the
same prompt side by side, the refusals in CLI words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from textual.widgets import DataTable, Static

from homelab_dp.app.compare import compare
from homelab_dp.app.runs import RunController
from homelab_dp.tui.screens.runs import MARK, CompareScreen, RunsScreen
from homelab_dp.tui.tui_app import HomelabApp
from tests.tui.conftest import open_app, plain, wait_for
from tests.unit.app.test_compare import recorded_run


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    """run-a (final eval 1.7, best 1.5) and run-b (final 1.2, a bench score) of sweep-x, and
    run-c (no eval, no sweep), each with a last sample for "Say hi"."""
    root = tmp_path / "runs"
    root.mkdir()
    recorded_run(root, "run-a", lr=1e-4, evals=[2.0, 1.5, 1.7])
    recorded_run(root, "run-b", lr=3e-4, evals=[1.9, 1.2])
    recorded_run(root, "run-c", lr=1e-3, evals=[], sweep=None)
    bench = {"model": "run-b", "tasks": {"tiny": {"acc": 0.75, "stderr": 0.1}}, "seconds": 3}
    (root / "run-b" / "bench.json").write_text(json.dumps(bench))
    return root


async def _listed(app: HomelabApp, pilot) -> RunsScreen:
    screen = app.screen
    assert isinstance(screen, RunsScreen)
    await wait_for(pilot, lambda: len(screen.runs) == 3, what="3 runs")
    return screen


async def _to(pilot, screen: RunsScreen, run_id: str) -> None:
    """Move the cursor to ``run_id`` with the arrow keys."""
    await pilot.press(*["up"] * len(screen.runs))  # to the top
    ids = [r["run_id"] for r in screen.runs]
    for _ in range(ids.index(run_id)):
        await pilot.press("down")
    assert screen.selected() == run_id


def _labels(screen: RunsScreen) -> dict[str, str]:
    table = screen.query_one("#runs", DataTable)
    labels = {run["run_id"]: table.rows[run["path"]].label for run in screen.runs}
    return {run_id: str(label or "").strip() for run_id, label in labels.items()}


def _cells(app: HomelabApp) -> tuple[list[str], list[list[str]]]:
    table = app.screen.query_one("#compare-table", DataTable)
    heads = [str(c.label) for c in table.ordered_columns]
    return heads, [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


async def test_space_marks_and_unmarks_runs(runs: Path) -> None:
    async with open_app(RunController(runs), mode="runs") as (app, pilot, _):
        screen = await _listed(app, pilot)
        await _to(pilot, screen, "run-a")
        await pilot.press("space")
        assert screen.marked_ids() == ["run-a"]
        assert _labels(screen) == {"run-a": MARK, "run-b": "", "run-c": ""}
        await _to(pilot, screen, "run-c")
        await pilot.press("space")
        assert sorted(screen.marked_ids()) == ["run-a", "run-c"]
        await _to(pilot, screen, "run-a")
        await pilot.press("space")  # again: unmarked
        assert screen.marked_ids() == ["run-c"]
        assert _labels(screen) == {"run-a": "", "run-b": "", "run-c": MARK}
        await pilot.press("r")  # a refresh keeps the marks
        await pilot.pause(0.2)
        assert screen.marked_ids() == ["run-c"]
        assert "space: mark" in plain(app, "#runs-help")
        keys = {b.key for b in screen.BINDINGS}  # type: ignore[union-attr]
        assert {"space", "c", "s"} <= keys


async def test_c_compares_the_marked_runs_ranked_by_eval_loss(runs: Path) -> None:
    async with open_app(RunController(runs), mode="runs") as (app, pilot, _):
        screen = await _listed(app, pilot)
        await pilot.press("space", "space", "space")  # marks each and moves down
        assert sorted(screen.marked_ids()) == ["run-a", "run-b", "run-c"]
        await pilot.press("c")
        await wait_for(pilot, lambda: isinstance(app.screen, CompareScreen), what="compare")
        heads, rows = _cells(app)
        assert heads == ["#", "run", "status", "train.lr", "eval loss", "best (step)", "tok/s",
                         "MFU", "peak mem", "energy", "time", "tiny.acc"]  # fmt: skip
        assert [row[:6] for row in rows] == [
            ["1", "run-b", "completed", "0.0003", "1.2000", "1.2000 (20)"],
            ["2", "run-a", "completed", "0.0001", "1.7000", "1.5000 (20)"],
            ["3", "run-c", "completed", "0.001", "–", "–"],
        ]
        assert [row[-1] for row in rows] == ["0.75", "–", "–"]  # the bench score, run-b only
        doc = compare(RunController(runs), ["run-a", "run-b", "run-c"])  # as the CLI reads it
        b = doc["runs"][0]
        assert rows[0][6] == f"{b['tokens_per_s']:.0f}" and rows[0][9] == f"{b['energy_wh']:.2f} Wh"
        assert rows[0][6] != "–" and rows[0][7] == "n/a" and rows[0][8].endswith("B")
        assert "settings that differ: train.lr" in plain(app, "#compare-head")
        assert plain(app, "#compare-prompt").strip() == "last sample for: Say hi"
        panes = [app.screen.query_one(f"#compare-sample-{i}", Static) for i in (1, 2, 3)]
        assert [p.border_title for p in panes] == [
            "#1 run-b · step 20", "#2 run-a · step 20", "#3 run-c · step 20"]  # fmt: skip
        assert [plain(app, f"#compare-sample-{i}").strip() for i in (1, 2, 3)] == [
            "late run-b", "late run-a", "late run-c"]  # fmt: skip
        await pilot.press("escape")
        assert app.screen is screen and len(screen.marked_ids()) == 3


async def test_s_compares_the_selected_runs_sweep(runs: Path) -> None:
    async with open_app(RunController(runs), mode="runs") as (app, pilot, notes):
        screen = await _listed(app, pilot)
        await _to(pilot, screen, "run-c")
        await pilot.press("s")  # run-c is in no sweep
        await pilot.pause(0.1)
        assert app.screen is screen
        assert notes[-1] == (
            "error: run run-c is not part of a sweep\n"
            "hint: mark runs with space, then press c to compare them",
            "error",
        )
        await _to(pilot, screen, "run-a")
        await pilot.press("s")
        await wait_for(pilot, lambda: isinstance(app.screen, CompareScreen), what="compare")
        _, rows = _cells(app)
        assert [row[:5] for row in rows] == [
            ["1", "run-b", "completed", "0.0003", "1.2000"],
            ["2", "run-a", "completed", "0.0001", "1.7000"],
        ]


async def test_c_with_fewer_than_two_marks_is_refused(runs: Path) -> None:
    async with open_app(RunController(runs), mode="runs") as (app, pilot, notes):
        screen = await _listed(app, pilot)
        await pilot.press("space", "c")
        await pilot.pause(0.1)
        assert app.screen is screen
        assert notes[-1] == (
            "error: compare: 1 run(s) marked; mark at least two\n"
            "hint: space marks the selected run (again: unmarks); "
            "s compares the selected run's sweep",
            "error",
        )
