"""A preset's model.path naming a run (issue 34, item 8): `run tiny-dpo --set model.path=RUN_ID`
resolves the id, a unique prefix or the run's folder from any current folder, as `status` does.

Hostile and damaged values of every kind: a full id, a unique prefix, an all-digit prefix (TOML
reads it as a number), a date-shaped one, an ambiguous prefix, a deleted run by id, by prefix
and by path, a name that is nothing, names too long for the system, a NUL, ``.``/``..``/``~``.
Each: the run's result, or ``error:`` + ``hint:``, exit 2, no traceback, nothing started.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from homelab_dp.app.runs import RunController
from homelab_dp.errors import HomelabError, RunNotFoundError
from homelab_dp.presets.preset import apply_overrides, preset_from_dict
from homelab_dp.presets.preset_store import with_resolved_paths
from homelab_dp.runs.model_ref import config_folder, run_result
from tests.conftest import run_cli
from tests.integration.conftest import DEMO_DATA, DEMO_MODEL, make_run

pytestmark = pytest.mark.beside  # in-process (or one short child): on the free worker

FULL = "20260101-000000-full-aaaa"
OTHER = "20260101-000001-full-bbbb"
LORA = "20260102-000000-sft-cccc"


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Three runs with results under the runs root, and a current folder far from it."""
    root = Path(os.environ["HOMELAB_DP_RUNS"])
    for name in (FULL, OTHER):
        shutil.copytree(DEMO_MODEL, make_run(root, DEMO_MODEL, DEMO_DATA, name=name) / "final")
    lora = make_run(root, DEMO_MODEL, DEMO_DATA, name=LORA, method="lora")
    shutil.copytree(DEMO_MODEL, lora / "final" / "merged")
    (lora / "final" / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "base_model_name_or_path": str(DEMO_MODEL)}), "utf-8"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return root


def _plan(capsys: pytest.CaptureFixture[str], model: str) -> tuple[int, str, str]:
    return run_cli(capsys, "plan", "tiny-dpo", "--gpus", "cpu:1", "--json", "--set",
                   f"model.path={model}")  # fmt: skip


@pytest.mark.parametrize(
    ("ref", "run"),
    [(FULL, FULL), ("20260101-000000", FULL), ("20260102", LORA), (OTHER[:17], OTHER)],
)
def test_a_run_id_or_unique_prefix_is_found_from_any_folder(runs: Path, ref: str, run: str) -> None:
    """The run's result is the model to start from, wherever the command is run; before the
    fix the value became CWD/REF ("not a folder") and an all-digit prefix a number."""
    prepared = RunController(runs).prepare("tiny-dpo", overrides=[f"model.path={ref}"],
                                           gpus="cpu:1")  # fmt: skip
    final = runs / run / "final"
    assert Path(prepared.preset.model.path) in (final, final / "merged")
    assert config_folder(ref) == Path(prepared.preset.model.path)


def test_the_plan_of_a_run_id_plans_the_runs_result(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = _plan(capsys, "20260102")
    assert rc == 0, err
    assert json.loads(out)["fits"] is True
    rc, out, err = run_cli(capsys, "plan", "--model", "20260101-000001", "--gpus", "cpu:1")
    assert rc == 0, err
    rc, out, err = run_cli(capsys, "plan", "--model", "nothing-here", "--gpus", "cpu:1")
    assert rc == 2 and "error: --model 'nothing-here': no model folder by that name" in err


def test_an_ambiguous_prefix_lists_its_candidates(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for prefix in ("2026", "20260101", "2"):  # all-digit: TOML would read a number
        rc, out, err = _plan(capsys, prefix)
        assert rc == 2 and "Traceback" not in err and out == ""
        assert f"run id prefix '{prefix}' matches" in err and FULL in err and "hint:" in err


def test_a_deleted_run_is_gone_by_id_prefix_and_path(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    RunController(runs)._run_dirs()  # seen once: the index knows where it was
    shutil.rmtree(runs / OTHER)
    for ref in (OTHER, OTHER[:17], str(runs / OTHER)):
        rc, _, err = _plan(capsys, ref)
        assert rc == 2 and "Traceback" not in err, err
        assert f"error: run {OTHER} was at {runs / OTHER}; that folder is gone" in err
        assert "hint:" in err
        with pytest.raises(RunNotFoundError, match="that folder is gone"):
            RunController(runs).prepare("tiny-dpo", overrides=[f"model.path={ref}"], gpus="cpu:1")
    # A prefix that also matches a present run: ambiguous, the gone one marked as gone.
    rc, _, err = _plan(capsys, "20260101")
    assert rc == 2 and f"{OTHER} (gone)" in err and FULL in err


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("nothing-by-that-name", "no run with that id or id prefix"),
        ("-", "no run with that id or id prefix"),
        ("a b", "no run with that id or id prefix"),
        ("x" * 300, "File name too long"),
        ("a/" * 3000, "File name too long"),
        ("2099", "no run with that id or id prefix"),
    ],
)
def test_a_name_that_is_nothing_is_refused_by_name(
    runs: Path, capsys: pytest.CaptureFixture[str], value: str, says: str
) -> None:
    rc, out, err = _plan(capsys, value)
    assert rc == 2 and out == "" and "Traceback" not in err
    assert says in err and "hint:" in err
    assert len(err.splitlines()[0]) < 400  # a long value is cut, not echoed whole


def test_a_nul_or_an_odd_name_in_a_preset_file_is_refused(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    preset = with_resolved_paths(
        preset_from_dict({"model": {"path": "run\x00id"}, "data": {"path": str(DEMO_DATA)}})
    )
    with pytest.raises(HomelabError, match="not a usable path") as err:
        config_folder(preset.model.path)
    assert "\x00" not in err.value.message  # shown escaped: one line, no raw NUL
    # ~user that does not exist: a path as typed (before: RuntimeError from expanduser).
    rc, _, err_text = _plan(capsys, "~no-such-user-xyz/x")
    assert rc == 2 and "Traceback" not in err_text and "is not a folder" in err_text
    # "." and ".." are folders (no run), never run ids: left to the model-folder checks.
    assert run_result(".") is None and run_result("..") is None


def test_a_text_field_takes_the_text_typed() -> None:
    """--set reads VALUE as TOML: a number or date in a text field is the text typed."""
    base = preset_from_dict({"model": {"path": "m"}, "data": {"path": "d"}})
    for raw in ("20260101", "2026-01-01", "1e3", "true", "0x1f"):
        assert apply_overrides(base, [f"model.path={raw}"]).model.path == raw
        assert apply_overrides(base, [f"model.revision={raw}"]).model.revision == raw
    with pytest.raises(HomelabError, match="train.max_steps"):  # a number field is still typed
        apply_overrides(base, ["train.max_steps=abc"])
