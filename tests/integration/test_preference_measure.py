"""`homelab-dp measure` of a DPO preset under torchrun (2 CPU ranks): the plan's memory model of
a preference objective (two sequences per pair, the full logits of both, the reference's
no-grad forward) agrees with the measured live tensor bytes within 5%, and the measurement is
stored under the objective's own key. One launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from homelab_dp.cli import main
from homelab_dp.planning.memory.memory_calibration import calibration_path
from tests.conftest import ROOT, write_preset

pytestmark = pytest.mark.slow
BOUND = 0.05
MODEL = ROOT / "assets" / "models" / "tiny-llama"
PAIRS = ROOT / "assets" / "data" / "tiny-preferences.jsonl"


def test_measure_of_dpo_agrees_with_the_plan(tmp_path: Path, capsys) -> None:
    preset = write_preset(tmp_path, "measure-dpo", MODEL, PAIRS, seq_len=64, pack=True,
                          method="lora", objective="dpo", max_steps=20)  # fmt: skip
    assert main(["measure", str(preset), "--steps", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["method"], out["distribution"]) == ("lora", "ddp")
    obj = out["objective"]
    assert (obj["name"], obj["reference"], obj["sequences_per_sample"]) == ("dpo", "adapters", 2)
    assert (obj["rows_per_micro_batch"], obj["row_len"]) == (2, 128)  # 2 pairs packed, 2 × 64
    est = out["estimate"]
    assert abs(out["error"]) <= BOUND, out["error"]
    assert [r["rank"] for r in out["ranks"]] == [0, 1]
    for r in out["ranks"]:
        assert r["peak_phase"] == est["peak_phase"] == "backward"
        for phase in ("forward", "backward", "optimizer"):
            got = r["phases"][phase]["peak_bytes"]
            assert abs(est["phases"][phase] - got) / got <= BOUND, (r["rank"], phase)

    # Stored under the objective's key: the DPO plan shows it, ORPO's (no reference) does not.
    stored = json.loads(calibration_path().read_text(encoding="utf-8"))["measurements"]
    assert len(stored) == 1
    shape = stored[0]["key"]["shape"]
    assert (shape["objective"], shape["reference"]) == ("dpo", "adapters")
    assert (shape["micro_batch"], shape["seq_len"]) == (2, 128)
    assert main(["plan", str(preset), "--json"]) == 0
    cal = json.loads(capsys.readouterr().out)["calibration"]
    assert cal["measured"]["tensor_bytes"] == out["measured_peak_bytes"]
    assert main(["plan", str(preset), "--json", "--set", "train.objective=orpo"]) == 0
    assert json.loads(capsys.readouterr().out)["calibration"]["measured"] is None
