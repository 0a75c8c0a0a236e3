"""`homelab-dp sweep`: the grid read with the preset's own checks, expanded, and refused with
exit 2 (error + hint, nothing queued) for a key that is not a field, a value of the wrong type,
and a grid no point of which fits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from homelab_dp.app.sweep import effective_grid, expand, parse_grid, point_overrides
from homelab_dp.errors import PresetError
from homelab_dp.presets.preset import apply_overrides
from homelab_dp.presets.preset_store import open_preset
from tests.conftest import ROOT, run_cli


def _queued() -> list[str]:
    runs = Path(os.environ["HOMELAB_DP_RUNS"])
    return sorted(p.name for p in runs.iterdir()) if runs.exists() else []


def test_grid_values_take_the_fields_types_and_expand_first_key_slowest() -> None:
    preset = open_preset("tiny-demo")
    grid = parse_grid(["train.lr=1e-4,2e-4", "lora.r=8,16", "data.pack=false"], preset)
    assert grid == {"train.lr": [1e-4, 2e-4], "lora.r": [8, 16], "data.pack": [False]}
    assert expand(grid) == [
        {"train.lr": 1e-4, "lora.r": 8, "data.pack": False},
        {"train.lr": 1e-4, "lora.r": 16, "data.pack": False},
        {"train.lr": 2e-4, "lora.r": 8, "data.pack": False},
        {"train.lr": 2e-4, "lora.r": 16, "data.pack": False},
    ]
    # an integer for a float field is converted, as in a preset file
    assert parse_grid(["train.lr=1"], preset) == {"train.lr": [1.0]}


def test_cli_grid_replaces_the_preset_tables_key_and_keeps_the_others() -> None:
    preset = apply_overrides(
        open_preset("tiny-demo"), ['sweep.grid={"train.lr" = [1e-3, 2e-3], "lora.r" = [4]}']
    )
    merged = effective_grid(preset, parse_grid(["lora.r=8,16"], preset))
    assert merged == {"train.lr": [1e-3, 2e-3], "lora.r": [8, 16]}
    assert len(expand(merged)) == 4


def test_a_point_becomes_overrides_the_preset_accepts() -> None:
    sets = point_overrides({"train.lr": 2e-4, "lora.r": 16, "data.pack": False})
    preset = open_preset("tiny-demo", sets)
    assert (preset.train.lr, preset.lora.r, preset.data.pack) == (2e-4, 16, False)
    assert preset.sweep.grid == {}  # a point is not a sweep


def test_a_bad_preset_table_key_is_named() -> None:
    preset = apply_overrides(open_preset("tiny-demo"), ['sweep.grid={"train.lrr" = [1e-3]}'])
    with pytest.raises(PresetError, match=r"\[sweep\] grid train.lrr: 'train.lrr' is not"):
        effective_grid(preset, {})


@pytest.mark.parametrize(
    ("grid", "error", "hint"),
    [
        ("train.lora.r=8,16", "'train.lora.r' is not a preset field", "did you mean lora.r"),
        ("train.lr=1e-4,fast", "value 'fast' refused: train.lr: expected a number",
         "each value of train.lr"),
        ("lora.r=8,16.5", "value 16.5 refused: lora.r: expected an integer", "each value"),
        ("lora.r=8,-1", "value -1 refused: lora.r: must be at least 1", "each value"),
        ("lora.r", "expected KEY=V1,V2", "--grid train.lr"),
        ("lora.r=8,", "an empty value", "--grid train.lr"),
    ],
)  # fmt: skip
def test_bad_grid_exits_2_with_error_and_hint_and_queues_nothing(
    capsys: pytest.CaptureFixture[str], grid: str, error: str, hint: str
) -> None:
    rc, out, err = run_cli(capsys, "sweep", "tiny-demo", "--grid", grid, "--gpus", "cpu:1")
    assert rc == 2, err
    first, second = err.strip().splitlines()[:2]
    assert first.startswith(f"error: --grid {grid}: ") and error in first, err
    assert second.startswith("hint: ") and hint in second, err
    assert "Traceback" not in err and out == ""
    assert _queued() == []


def test_no_grid_at_all_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(capsys, "sweep", "tiny-demo", "--gpus", "cpu:1")
    assert rc == 2 and "error: sweep: no grid" in err and "hint: " in err
    assert _queued() == []


def test_a_sweep_no_point_of_which_fits_exits_2_and_queues_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    big = ROOT / "assets" / "configs" / "meta-llama-3-70b"
    rc, out, err = run_cli(
        capsys, "sweep", "tiny-demo", "--gpus", "cpu:1", "--set", f"model.path={big}",
        "--set", "train.method=full", "--grid", "train.lr=1e-4,2e-4",
    )  # fmt: skip
    assert rc == 2 and out == ""
    first = err.splitlines()[0]
    assert first.startswith("error: sweep: no point of the grid fits, nothing queued")
    # each point says why
    assert "train.lr=0.0001: does not fit" in first and "train.lr=0.0002: does not fit" in first
    assert err.splitlines()[1].startswith("hint: ")
    assert _queued() == []
