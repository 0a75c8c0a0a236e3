"""Screen 5, Runs: `e` asks for a format and a folder and exports the selected run's result
(in a child process: `python -m homelab_dp.app.export`)."""

from __future__ import annotations

import json
from pathlib import Path

from textual.widgets import Input, Select

from homelab_dp.app.runs import RunController
from homelab_dp.tui.screens.export_dialog import ExportDialog, default_out
from homelab_dp.tui.screens.runs import RunsScreen
from tests.integration.conftest import DEMO_DATA, DEMO_MODEL, make_run
from tests.tui.conftest import open_app, wait_for

LORA = "20260301-000000-tiny-lora-e5e5"


def _lora_run(root: Path) -> Path:
    """A LoRA run whose result is an adapter folder (an adapter export copies it as it is)."""
    run_dir = make_run(root, DEMO_MODEL, DEMO_DATA, name=LORA, method="lora")
    final = run_dir / "final"
    final.mkdir()
    config = {"peft_type": "LORA", "base_model_name_or_path": str(DEMO_MODEL), "r": 4}
    (final / "adapter_config.json").write_text(json.dumps(config), encoding="utf-8")
    (final / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    return run_dir


async def test_export_dialog_exports_the_selected_run(runs_root: Path, tmp_path: Path) -> None:
    run_dir = _lora_run(runs_root)
    out = tmp_path / "exported"
    async with open_app(RunController(runs_root), mode="runs") as (app, pilot, notes):
        screen = app.screen
        assert isinstance(screen, RunsScreen)
        await wait_for(pilot, lambda: len(screen.runs) == 2, what="2 runs")
        row = [r["run_id"] for r in screen.runs].index(LORA)
        await pilot.press(*["down"] * row)
        assert screen.selected() == LORA
        await pilot.press("e")
        dialog = app.screen
        assert isinstance(dialog, ExportDialog)
        folder = dialog.query_one("#export-out", Input)
        assert folder.value == str(default_out(LORA, "merged"))
        assert folder.parent.size.height == 3  # shown whole (border and text), not cut to a line
        dialog.query_one("#export-format", Select).value = "adapter"
        await pilot.pause()
        assert folder.value == str(default_out(LORA, "adapter"))  # the default follows
        folder.value = str(out)
        await pilot.press("enter")
        assert app.screen is screen
        await wait_for(pilot, lambda: len(notes) >= 2, timeout=60, what="the export's result")
    assert notes[0] == (f"exporting {LORA} as adapter to {out}", "information")
    size = sum(f.stat().st_size for f in (run_dir / "final").iterdir())
    assert notes[1] == (f"exported adapter to {out}: 2 files, {size} B", "information")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json",
                                                      "adapter_model.safetensors"]  # fmt: skip
    assert (out / "adapter_model.safetensors").read_bytes() == (
        run_dir / "final" / "adapter_model.safetensors"
    ).read_bytes()


async def test_an_export_error_is_shown_in_cli_words(runs_root: Path, tmp_path: Path) -> None:
    """The recorded run has no result: the child's error comes back as a notification."""
    async with open_app(RunController(runs_root), mode="runs") as (app, pilot, notes):
        screen = app.screen
        await wait_for(pilot, lambda: len(screen.runs) == 1, what="the run")
        await pilot.press("e")
        app.screen.query_one("#export-out", Input).value = str(tmp_path / "x")
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(notes) >= 2, timeout=60, what="the export's error")
    message, severity = notes[1]
    assert severity == "error" and "has no result yet" in message and "hint:" in message
    assert not (tmp_path / "x").exists()
