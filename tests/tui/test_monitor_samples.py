"""The Monitor's samples panel (samples while training): the latest step's answers beside their
prompts, earlier steps one key (s) away, back to the latest after the oldest; absent for a run
without samples. Recorded events, no launch."""

from __future__ import annotations

import json
from pathlib import Path

from textual.widgets import Static

from homelab_dp.app.runs import RunController
from tests.tui.conftest import RUN_ID, copy_run, open_monitor, shows_snapshot

SAMPLES = [
    (10, "Name a colour.", "Blue, [b]not[/b] markup."),
    (10, "Two plus two?", "Four."),
    (20, "Name a colour.", "Red."),
    (20, "Two plus two?", "4"),
]


def panel_text(app) -> str:
    return str(app.screen.query_one("#samples", Static).render())


async def test_latest_samples_beside_their_prompts_earlier_ones_a_key_away(
    controller: RunController, runs_root: Path
) -> None:
    run_dir = copy_run(runs_root, "20250301-111500-with-samples-0001", status="completed")
    with open(run_dir / "events.jsonl", "a", encoding="utf-8") as fh:
        for step, prompt, text in SAMPLES:
            fh.write(json.dumps({"type": "sample", "step": step, "prompt": prompt, "text": text,
                                 "tokens": 5, "seconds": 0.25}) + "\n")  # fmt: skip
    async with open_monitor(controller, run_dir.name, shows_snapshot) as (app, pilot, _):
        panel = app.screen.query_one("#samples", Static)
        assert panel.display
        text = panel_text(app)
        assert "samples at step 20 (latest" in text
        assert "Name a colour." in text and "Red." in text and "Two plus two?" in text
        assert "Blue" not in text and "5 tokens, 0.2 s" in text
        await pilot.press("s")
        text = panel_text(app)
        assert "samples at step 10 (1 of 2" in text and "Blue, [b]not[/b] markup." in text
        assert "Red." not in text
        await pilot.press("s")
        assert "samples at step 20 (latest" in panel_text(app)


async def test_a_run_without_samples_has_no_samples_panel(controller: RunController) -> None:
    async with open_monitor(controller, RUN_ID, shows_snapshot) as (app, pilot, _):
        assert not app.screen.query_one("#samples", Static).display
        await pilot.press("s")  # nothing to step through: no error
        assert not app.screen.query_one("#samples", Static).display
