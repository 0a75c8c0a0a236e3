"""The Plan screen plans a model given by Hugging Face id (the offline hub cache of
`tests/hub_cache.py`): from the cache while typing; Enter may download its config.json."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import Input

from homelab_dp.app.runs import RunController
from homelab_dp.tui.screens.plan import field_id
from tests.hub_cache import REPO_ID, make_hub_cache, use_hub_cache
from tests.tui.conftest import open_app, plain, wait_for


@pytest.mark.usefixtures("in_repo")
async def test_plan_screen_plans_a_model_id(
    controller: RunController, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hub"
    make_hub_cache(cache)
    use_hub_cache(monkeypatch, cache)
    async with open_app(controller, mode="plan", preset="tiny-demo") as (app, pilot, notes):
        model = app.screen.query_one(f"#{field_id('model.path')}", Input)
        folder_plan, before = app.session.planned.plan.to_json(), app.screen.plans_made
        model.value = REPO_ID  # typed: re-planned once typing pauses, from the cache
        await wait_for(pilot, lambda: app.screen.plans_made > before, what="the plan of the id")
        assert app.session.planned.preset.model.path == REPO_ID
        assert (
            app.session.planned.plan.to_json()["per_device_bytes"]
            == folder_plan["per_device_bytes"]
        )
        model.value = "someone/missing"  # not cached: no download while typing
        await wait_for(pilot, lambda: "someone/missing" in plain(app, "#plan-view"), what="error")
        assert app.session.planned is None
        assert "press Enter in the model field" in notes[-1][0]
        model.focus()
        await pilot.press("enter")  # Enter may download; offline, it says so
        await wait_for(pilot, lambda: "HF_HUB_OFFLINE is set" in notes[-1][0], what="offline")
        assert "homelab-dp pull someone/missing" in notes[-1][0]
