"""Non-finite numbers: refused in every preset field and ``--set``; never written as JSON.

``lr = inf`` used to complete a run whose weights were all NaN and ``lr = nan`` to start
processes before failing; ``status --json`` printed ``NaN`` (not JSON). Now a non-finite number
anywhere in a preset is exit 2 naming the field, before anything starts, and every JSON writer
goes through `homelab_dp.json_safe` (non-finite floats become null).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import psutil
import pytest

from homelab_dp import json_safe
from homelab_dp.cli import main
from homelab_dp.presets.preset import load_preset

from ..conftest import DATA, ROOT

pytestmark = pytest.mark.beside  # in-process (or one short child): on the free worker

TINY = ROOT / "presets" / "tiny-demo.toml"
COMPLETED = DATA / "bad_input" / "runs" / "completed-run"


def _strict(text: str) -> object:
    def refuse(name: str) -> object:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def _refused(argv: list[str], field: str, capsys: pytest.CaptureFixture[str]) -> None:
    runs = Path(os.environ["HOMELAB_DP_RUNS"])
    runs.mkdir(parents=True, exist_ok=True)
    before = sorted(runs.iterdir())
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    rc = main([*argv, "--detach"])
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert rc == 2 and out.out == "", out
    assert lines[0].startswith("error: ") and field in lines[0], lines
    assert "finite" in lines[0], lines
    assert lines[-1].startswith("hint: "), lines
    assert "Traceback" not in out.err
    assert sorted(runs.iterdir()) == before, "a run folder was made"
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children, "spawned"


@pytest.mark.parametrize(
    ("key", "literal"),
    [("train.lr", "inf"), ("train.lr", "nan"), ("train.lr", "-inf"), ("train.lr", "1e999"),
     ("train.weight_decay", "nan"), ("train.max_grad_norm", "inf"), ("train.epochs", "nan"),
     ("cost.per_kwh", "inf"), ("data.eval_fraction", "nan"), ("lora.dropout", "nan"),
     ("train.min_lr_ratio", "-nan")],
)  # fmt: skip
def test_a_non_finite_preset_value_is_refused(key, literal, tmp_path, in_repo, capsys) -> None:
    section, name = key.split(".")
    text = TINY.read_text(encoding="utf-8")
    if f"[{section}]" not in text:
        text += f"\n[{section}]\n"
    text = text.replace(f"[{section}]\n", f"[{section}]\n{name} = {literal}\n", 1)
    lines = [ln for ln in text.splitlines() if not ln.startswith(f"{name} = ") or
             ln == f"{name} = {literal}"]  # fmt: skip
    preset = tmp_path / "non-finite.toml"
    preset.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert not math.isfinite(float(literal.replace("-nan", "nan")))
    _refused(["run", str(preset)], key, capsys)


@pytest.mark.parametrize(
    "setting",
    ["train.lr=nan", "train.lr=inf", "train.lr=-inf", "train.lr=+inf", "train.warmup_steps=inf",
     "train.max_steps=nan", "train.weight_decay=nan", "train.watchdog_s=inf",
     "data.seq_len=inf", "cost.per_kwh=nan"],
)  # fmt: skip
def test_a_non_finite_set_is_refused(setting, in_repo, capsys) -> None:
    _refused(["run", "tiny-demo", "--set", setting], setting.split("=")[0], capsys)


def test_a_finite_value_still_loads(tmp_path: Path, in_repo: Path) -> None:
    preset = tmp_path / "fine.toml"
    preset.write_text(TINY.read_text(encoding="utf-8").replace("lr = 3e-3", "lr = 1e-30"))
    assert load_preset(preset).train.lr == 1e-30


def test_json_safe_turns_non_finite_into_null() -> None:
    doc = {"a": math.nan, "b": [math.inf, 1.5, {"c": -math.inf}], "d": (2, math.nan), "e": "nan"}
    text = json_safe.dumps(doc)
    assert _strict(text) == {"a": None, "b": [None, 1.5, {"c": None}], "d": [2, None], "e": "nan"}
    assert json_safe.finite(math.nan) is None and json_safe.finite(1.0) == 1.0


def test_what_a_default_turns_into_json_is_made_finite_too() -> None:
    """The worker's events carry tensors, made numbers by the writer's ``default``: a NaN
    loss tensor is written as null, never as NaN (nor refused by ``allow_nan=False``)."""

    def as_number(obj: object) -> float:
        assert isinstance(obj, complex)  # the stand-in for a tensor: json cannot write it
        return obj.real

    text = json_safe.dumps({"loss": complex(math.nan, 0), "lr": complex(2.0, 0)}, default=as_number)
    assert _strict(text) == {"loss": None, "lr": 2.0}


def test_the_event_log_writes_a_nan_loss_as_null(tmp_path: Path) -> None:
    import torch

    from homelab_dp.runs.run_events import StepEvent
    from homelab_dp.train.loop.event_log import EventLog

    log = EventLog(tmp_path / "events.jsonl", enabled=True)
    log.write(StepEvent(step=3, loss=torch.tensor(math.nan), lr=math.inf))
    line = (tmp_path / "events.jsonl").read_text(encoding="utf-8")
    doc = _strict(line)
    assert doc["loss"] is None and doc["lr"] is None and doc["step"] == 3


def test_status_of_a_run_with_a_nan_loss_is_valid_json(capsys) -> None:
    runs = Path(os.environ["HOMELAB_DP_RUNS"])
    run = runs / "nan-run"
    shutil.copytree(COMPLETED, run)
    spec = json.loads((run / "spec.json").read_text(encoding="utf-8"))
    spec["run_id"] = "nan-run"
    (run / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
    with open(run / "events.jsonl", "a", encoding="utf-8") as fh:  # what a diverged run wrote
        fh.write('{"type": "step", "time": 1795900001.0, "step": 3, "loss": NaN, '
                 '"tokens_per_s": Infinity, "lr": -Infinity}\n')  # fmt: skip
    assert main(["status", "nan-run", "--json"]) == 0
    doc = _strict(capsys.readouterr().out)
    assert isinstance(doc, dict) and doc["loss"] is None and doc["tokens_per_s"] is None
    assert doc["step"] == 3
    assert main(["runs", "--json"]) == 0
    rows = _strict(capsys.readouterr().out)
    assert [r["loss"] for r in rows if r["run_id"] == "nan-run"] == [None]
    assert main(["status", "nan-run"]) == 0  # the text view too
    assert "nan-run" in capsys.readouterr().out
