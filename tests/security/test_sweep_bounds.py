"""`homelab-dp sweep` with hostile and damaged grids: a grid too large to plan is refused before
any value is checked or any point planned (10^6 points, in one key or across keys, from --grid
or the preset's table); the error of a sweep none of whose points fits stays one short line
whatever the count; list values keep the commas inside their brackets, and unbalanced brackets
or quotes are named; a key given twice is refused, not silently the last. Every refusal: exit 2,
error and hint, nothing queued."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from homelab_dp.app.sweep import MAX_POINTS, expand, parse_grid, point_overrides, split_values
from homelab_dp.errors import PresetError
from homelab_dp.presets.preset_store import open_preset
from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.beside  # in-process (or one short child): on the free worker

BIG = ROOT / "assets" / "configs" / "meta-llama-3-70b"
REFUSE_S = 20.0
"""Liveness bound for a refusal that plans nothing (checking 10^6 values one by one, as the old
sweep did, takes minutes)."""


def _queued() -> list[str]:
    runs = Path(os.environ["HOMELAB_DP_RUNS"])
    return sorted(p.name for p in runs.iterdir()) if runs.exists() else []


def _refused(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[str, str]:
    start = time.monotonic()
    rc, out, err = run_cli(capsys, "sweep", "tiny-demo", "--gpus", "cpu:1", *args)
    assert time.monotonic() - start < REFUSE_S
    assert rc == 2 and out == "" and "Traceback" not in err, err
    first, second = err.strip().splitlines()[:2]
    assert first.startswith("error: ") and second.startswith("hint: "), err
    assert _queued() == []
    return first, second


def _values(n: int, scale: float = 1e-6) -> str:
    return ",".join(f"{(i + 1) * scale:.9g}" for i in range(n))


@pytest.mark.parametrize(
    "grid",
    [
        [f"train.lr={_values(1_000_000)}"],
        [f"train.lr={_values(1000)}", f"lora.r={','.join(str(i) for i in range(1, 1001))}"],
        [f"train.lr={_values(MAX_POINTS // 2 + 1)}", "lora.r=4,8"],
    ],
    ids=["one-key-10^6", "two-keys-10^6", "just-over"],
)
def test_a_grid_too_large_is_refused_before_anything_is_planned(
    capsys: pytest.CaptureFixture[str], grid: list[str]
) -> None:
    first, second = _refused(capsys, *(a for g in grid for a in ("--grid", g)))
    assert f"a sweep plans and queues at most {MAX_POINTS:,}" in first
    assert "points or more" in first and len(first) < 300  # the values are not echoed
    assert "fewer values" in second


def test_the_presets_own_grid_is_bounded_too(capsys: pytest.CaptureFixture[str]) -> None:
    table = f'sweep.grid={{"train.lr" = [{_values(2000)}]}}'
    first, _ = _refused(capsys, "--set", table)
    assert "[sweep] grid train.lr: the grid has 2,000 points or more" in first


def test_a_grid_at_the_limit_is_expanded_whole() -> None:
    preset = open_preset("tiny-demo")
    grid = parse_grid([f"train.lr={_values(MAX_POINTS // 4)}", "lora.r=4,8,16,32"], preset)
    assert len(expand(grid)) == MAX_POINTS


def test_many_refused_points_give_one_short_line(capsys: pytest.CaptureFixture[str]) -> None:
    first, _ = _refused(
        capsys, "--set", f"model.path={BIG}", "--set", "train.method=full",
        "--grid", f"train.lr={_values(40)}",
    )  # fmt: skip
    assert first.startswith("error: sweep: no point of the grid fits, nothing queued")
    assert "train.lr=1e-06: does not fit" in first and "train.lr=3e-06: does not fit" in first
    assert "and 37 more points of 40 (37 refused for the first reason)" in first
    assert "train.lr=4e-06" not in first and len(first) < 1500, len(first)


def test_list_values_keep_the_commas_inside_their_brackets() -> None:
    preset = open_preset("tiny-demo")
    raw = 'lora.target_modules=["q_proj","v_proj"], ["q_proj"] ,all-linear'
    grid = parse_grid([raw, "lora.r=4"], preset)
    assert grid == {"lora.target_modules": [["q_proj", "v_proj"], ["q_proj"], "all-linear"],
                    "lora.r": [4]}  # fmt: skip
    points = expand(grid)
    assert [p["lora.target_modules"] for p in points] == [["q_proj", "v_proj"], ["q_proj"],
                                                          "all-linear"]  # fmt: skip
    again = open_preset("tiny-demo", point_overrides(points[0]))
    assert again.lora.target_modules == ["q_proj", "v_proj"]
    # commas inside quotes and nested brackets stay too; a repeated list is one point
    assert split_values('"a,b",[[1,2],[3]],{x = 1, y = 2}', "w") == [
        '"a,b"', "[[1,2],[3]]", "{x = 1, y = 2}"]  # fmt: skip
    assert len(expand(parse_grid(['lora.target_modules=["q_proj"],["q_proj"]'], preset))) == 1


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ('["q_proj","v_proj"', "an unclosed ']'"),
        ('"q_proj', 'an unclosed quote "'),
        ('q_proj],["v_proj"]', "unbalanced ']' at character 7"),
        ('["q_proj"}', "unbalanced '}' at character 10"),
        ('["q_proj"],,["v_proj"]', "an empty value"),
        ("[1, 2]", "value [1, 2] refused: lora.target_modules: expected"),
    ],
)
def test_damaged_list_values_are_named(
    capsys: pytest.CaptureFixture[str], value: str, error: str
) -> None:
    first, _ = _refused(capsys, "--grid", f"lora.target_modules={value}")
    assert first.startswith(f"error: --grid lora.target_modules={value}: ") and error in first


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--grid", "lora.r=4", "--grid", "lora.r=8,16"],
         "--grid lora.r=8,16: lora.r is given twice (also as --grid lora.r=4)"),
        (["--grid", " lora.r =4", "--grid", "lora.r=8"], "lora.r is given twice"),
        (["--set", "lora.r=4", "--grid", "lora.r=8,16"],
         "--set lora.r=4: lora.r is also swept"),
        (["--set", "train.lr=1e-4", "--set", "train.lr=2e-4", "--grid", "lora.r=8,16"],
         "--set train.lr=2e-4: train.lr is given twice (also --set train.lr=1e-4)"),
        (["--set", 'sweep.grid={"lora.r" = [4]}', "--set", "lora.r=2"],
         "--set lora.r=2: lora.r is also swept"),
    ],
)  # fmt: skip
def test_a_key_given_twice_is_refused(
    capsys: pytest.CaptureFixture[str], args: list[str], error: str
) -> None:
    first, _ = _refused(capsys, *args)
    assert error in first, first


def test_split_values_refuses_an_empty_list_of_values() -> None:
    for raw in ("", " ", ",", "a,"):
        with pytest.raises(PresetError, match="an empty value"):
            split_values(raw, "--grid k=")
