"""Screen 2, Plan: presets, in-place edits, what-if hardware, errors with the CLI's wording."""

from __future__ import annotations

import pytest
from textual.widgets import Input, Select

from homelab_dp.app.runs import RunController
from homelab_dp.tui.screens.plan import PlanScreen, field_id
from homelab_dp.tui.tui_app import HomelabApp
from tests.tui.conftest import open_app, plain, wait_for

SMOLLM = "smollm2-135m-lora-2x12gb"


async def _type(pilot, app: HomelabApp, key: str, text: str) -> None:
    """Focus a field editor, replace its text by typing, and submit it with enter."""
    widget = app.screen.query_one(f"#{field_id(key)}" if "." in key else f"#{key}", Input)
    widget.focus()
    await pilot.pause()
    widget.value = ""
    await pilot.press(*text, "enter")
    await pilot.pause()


@pytest.mark.usefixtures("gpus_2x3090")
async def test_shows_the_plan_of_the_chosen_preset(controller: RunController) -> None:
    async with open_app(controller, mode="plan", preset=SMOLLM) as (app, pilot, _):
        assert isinstance(app.screen, PlanScreen)
        text = plain(app, "#plan-view")
        assert "FITS" in text and "LoRA · ddp" in text
        assert "effective batch 32 = micro 4 × 2 dev × accum 4" in text
        assert "lr 0.0001" in text
        # a stacked bar per device size for every candidate, the chosen one marked
        assert "▶ lora · ddp" in text
        assert text.count("2× 24.0 GiB █") == 10  # full ×4, lora ×3, qlora ×3 (FSDP too)
        assert app.session.planned is not None
        assert app.session.planned.plan.world_size == 2


@pytest.mark.usefixtures("gpus_2x3090")
async def test_editing_a_field_replans_with_the_new_value(controller: RunController) -> None:
    async with open_app(controller, mode="plan", preset=SMOLLM) as (app, pilot, _):
        before = app.screen.plans_made
        await _type(pilot, app, "train.micro_batch", "2")
        await _type(pilot, app, "train.grad_accum", "3")
        assert app.screen.plans_made > before
        plan = app.session.planned.plan
        assert (plan.micro_batch, plan.grad_accum, plan.effective_batch) == (2, 3, 12)
        assert "effective batch 12 = micro 2 × 2 dev × accum 3" in plain(app, "#plan-view")
        assert app.session.overrides() == ["train.micro_batch=2", "train.grad_accum=3"]


@pytest.mark.usefixtures("gpus_2x3090")
async def test_what_if_hardware_plans_for_cards_we_do_not_have(controller: RunController) -> None:
    async with open_app(controller, mode="plan", preset=SMOLLM) as (app, pilot, _):
        await _type(pilot, app, "gpus", "4x80GiB")
        hardware = app.session.planned.hardware
        assert hardware.world_size == 4 and hardware.source == "--gpus 4x80GiB"
        assert "4× 80.0 GiB" in plain(app, "#plan-view")
        assert "effective batch 64" in plain(app, "#plan-view")


@pytest.mark.usefixtures("gpus_2x3090")
async def test_a_pinned_method_changes_the_decision(controller: RunController) -> None:
    async with open_app(controller, mode="plan", preset=SMOLLM) as (app, pilot, _):
        app.screen.query_one(f"#{field_id('train.method')}", Select).value = "full"
        await pilot.pause()
        assert app.session.planned.plan.chosen.method == "full"
        assert "▶ full · ddp" in plain(app, "#plan-view")


@pytest.mark.usefixtures("gpus_2x3090")
async def test_choosing_a_preset_with_the_keyboard_loads_its_fields(
    controller: RunController,
) -> None:
    async with open_app(controller, mode="plan", preset="tiny-demo") as (app, pilot, _):
        assert app.screen.focused.id == "preset"
        await pilot.press("enter")  # open the list
        await pilot.press("home", "enter")  # the first preset, alphabetically
        await wait_for(pilot, lambda: app.session.preset_name != "tiny-demo", what="the preset")
        assert app.session.preset_name == "gpt-oss-20b-lora-2x24gb"
        seq_len = app.screen.query_one(f"#{field_id('data.seq_len')}", Input)
        assert seq_len.value == "2048"
        assert "LoRA" in plain(app, "#plan-view") and "active" in plain(app, "#plan-view")


@pytest.mark.usefixtures("gpus_2x3090")
async def test_a_bad_value_is_reported_as_the_cli_reports_it(controller: RunController) -> None:
    async with open_app(controller, mode="plan", preset=SMOLLM) as (app, pilot, notes):
        await _type(pilot, app, "train.micro_batch", "0")
        assert app.session.planned is None
        errors = [text for text, severity in notes if severity == "error"]
        assert len(errors) == 1
        lines = errors[0].splitlines()
        assert (
            lines[0].startswith("error: ") and "train.micro_batch: must be at least 1" in lines[0]
        )
        assert lines[-1].startswith("hint: ")
        assert "train.micro_batch: must be at least 1" in plain(app, "#plan-view")
        await _type(pilot, app, "train.micro_batch", "2")  # fixed: the plan comes back
        assert app.session.planned is not None


@pytest.mark.usefixtures("gpus_2x3090")
async def test_a_bad_gpus_spec_gives_the_cli_error(controller: RunController) -> None:
    async with open_app(controller, mode="plan", preset=SMOLLM) as (app, pilot, notes):
        await _type(pilot, app, "gpus", "2xbanana")
        (error,) = [text for text, severity in notes if severity == "error"]
        assert error.startswith("error: --gpus: cannot read the memory size 'banana'")
        assert "hint: use e.g. --gpus 2x24GiB" in error


@pytest.mark.usefixtures("gpus_2x3090")
async def test_focusing_a_field_explains_it(controller: RunController) -> None:
    async with open_app(controller, mode="plan", preset=SMOLLM) as (app, pilot, _):
        app.screen.query_one(f"#{field_id('train.grad_accum')}").focus()
        await pilot.pause()
        assert "train.grad_accum: Micro-steps accumulated" in plain(app, "#field-help")


@pytest.mark.usefixtures("gpus_2x3090")
async def test_number_keys_type_into_fields_and_switch_screens_after_escape(
    controller: RunController,
) -> None:
    async with open_app(controller, mode="plan", preset=SMOLLM) as (app, pilot, _):
        seq_len = app.screen.query_one(f"#{field_id('data.seq_len')}", Input)
        seq_len.focus()
        seq_len.value = ""
        await pilot.press("1", "0", "2", "4")
        assert seq_len.value == "1024"
        assert isinstance(app.screen, PlanScreen)
        await pilot.press("escape", "1")
        assert app.current_mode == "hardware"


@pytest.mark.usefixtures("gpus_2x3090")
async def test_serving_the_result_under_the_plan(controller: RunController) -> None:
    async with open_app(controller, mode="plan", preset="llama3-8b-qlora-2x24gb") as (
        app,
        pilot,
        _,
    ):
        text = plain(app, "#serve-view")
        assert text.startswith("Serving the result")
        assert "SERVES  2 replica(s), one per card" in text
        assert "8 KV heads × 128 head dim × 4096 tokens × 8 sequences × 2 bytes" in text
        await _type(pilot, app, "gpus", "2x12GiB")  # 8B in 16-bit: 15 GiB of weights
        text = plain(app, "#serve-view")
        assert "DOES NOT FIT ONE CARD" in text
        assert "Replicas cannot help a model that does not fit one card" in text


@pytest.mark.usefixtures("gpus_2x3090")
async def test_ctrl_l_finds_the_longest_seq_len(controller: RunController) -> None:
    """The Plan screen shows `plan --find-seq-len`'s answer when asked (a second or two of
    budgets, so never on each keystroke), the same words as the CLI's."""
    async with open_app(controller, mode="plan", preset=SMOLLM) as (app, pilot, _):
        assert "sequence-length finder" not in plain(app, "#plan-view")
        app.set_focus(None)
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: "sequence-length finder" in plain(app, "#plan-view"))
        found = app.session.planned.plan.seq_len_finder
        assert found is not None and found.max_seq_len > 2048
        text = plain(app, "#plan-view")
        assert f"{found.max_seq_len:,} tokens" in text and "lora · ddp:" in text
