"""`homelab-dp measure` under torchrun (2 CPU ranks), what it stores, and every run's memory event."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from homelab_dp.cli import main
from homelab_dp.planning.memory.device_memory import TrainShape, budget
from homelab_dp.planning.memory.memory_calibration import calibration_path
from homelab_dp.planning.model_spec import load_model_spec
from tests.conftest import write_preset
from tests.integration.conftest import events, make_run, run

pytestmark = pytest.mark.slow
BOUND = 0.10
PHASES = {"load", "forward", "backward", "optimizer"}


def test_measure_compares_every_rank_stores_it_and_plan_shows_it(
    tiny_model: Path, data_dir: Path, tmp_path: Path, capsys
) -> None:
    data = data_dir / "ragged-64.jsonl"
    preset = write_preset(
        tmp_path, "measure-me", tiny_model, data, max_steps=50, checkpoint_every=10
    )
    assert main(["measure", str(preset), "--steps", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kind"] == "live_tensor_bytes" and out["steps"] == [1, 2]
    assert (out["method"], out["distribution"]) == ("full", "ddp")
    assert [r["rank"] for r in out["ranks"]] == [0, 1]
    est = out["estimate"]
    assert abs(out["error"]) <= BOUND
    for r in out["ranks"]:
        assert set(r["phases"]) == PHASES and r["peak_phase"] == est["peak_phase"]
        for phase in ("forward", "backward", "optimizer"):
            got = r["phases"][phase]["peak_bytes"]
            assert abs(est["phases"][phase] - got) / got <= BOUND, (r["rank"], phase)
        assert r["peak_by_category"]["weights"] == load_model_spec(tiny_model).params * 4
        assert r["process_peak_bytes"] > r["peak_bytes"]  # the process holds more than tensors

    # The measure run: its own folder, no checkpoint, no result, a final state.
    run_dir = Path(out["run_dir"])
    assert run_dir.name.startswith(out["run_id"]) and "measure-me" in run_dir.name
    assert not list((run_dir / "checkpoints").iterdir()) and not (run_dir / "final").exists()
    state = json.loads((run_dir / "state.json").read_text(encoding="utf-8"))
    assert state["status"] == "completed" and state["reason"] == "measured"
    assert events(run_dir, "end")[-1]["reason"] == "measured"

    # Stored for this hardware; the next plan shows it and uses the measured overhead.
    stored = json.loads(calibration_path().read_text(encoding="utf-8"))["measurements"]
    assert len(stored) == 1 and stored[0]["fingerprint"] == out["fingerprint"]
    assert stored[0]["measured_tensor_bytes"] == out["measured_peak_bytes"]
    assert main(["plan", str(preset), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    cal = plan["calibration"]
    assert cal["fingerprint"] == out["fingerprint"] and cal["measurements"] == 1
    assert cal["measured"]["tensor_bytes"] == out["measured_peak_bytes"]
    assert cal["sources"]["overhead"] == "measured" and cal["sources"]["tensors"] == "measured"
    # The measured overhead makes the total the measured process peak, give or take the
    # difference between estimated and measured tensors (and its assumed slack).
    process = max(r["process_peak_bytes"] for r in out["ranks"])
    per, frag = plan["per_device_bytes"], cal["overhead"]["fragmentation"]
    tensors = per["total"] - per["overhead"]
    expected = process + (tensors - out["measured_peak_bytes"]) * (1 + frag)
    assert abs(per["total"] - expected) <= 2


def test_a_normal_run_records_one_estimate_and_measurement(
    tiny_model: Path, data_dir: Path, tmp_path: Path
) -> None:
    rd = make_run(tmp_path, tiny_model, data_dir / "ragged-16.jsonl", name="probed", micro=2)
    assert run(rd, 2) == 0
    mem = events(rd, "memory")
    assert len(mem) == 1  # one probed step, nothing after it
    m = mem[0]
    assert m["mode"] == "run" and m["steps"] == [3] and len(m["ranks"]) == 2
    shape = TrainShape(method="full", distribution="ddp", world_size=2, device="cpu",
                       dtype="fp32", micro_batch=2, seq_len=32, packed=False)  # fmt: skip
    est = budget(load_model_spec(tiny_model), shape)
    for r in m["ranks"]:
        assert {"forward", "backward", "optimizer"} == set(r["phases"])
        assert abs(est.tensors - r["peak_bytes"]) / r["peak_bytes"] <= BOUND
        assert r["peak_phase"] == est.peak_phase
    steps = events(rd, "step")
    assert [e["step"] for e in steps] == [1, 2, 3]
