"""Calibration: measurements per hardware fingerprint, corrected overhead, measured vs assumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from homelab_dp.byte_units import GiB
from homelab_dp.planning.memory.device_memory import MiB, Overhead, TrainShape, assumed_overhead
from homelab_dp.planning.memory.memory_calibration import (
    KEEP_PER_FINGERPRINT,
    CalibrationStore,
    HardwareCalibration,
    Measurement,
    calibration_path,
    config_key,
    corrected_overhead,
    fingerprint,
)
from homelab_dp.planning.model_spec import spec_from_config
from homelab_dp.planning.plan_hardware import parse_gpus_spec
from homelab_dp.planning.planner import measurement_key, plan
from homelab_dp.presets.preset import preset_from_dict
from tests.unit.planning.test_planner import SMOLLM_135M

CPU_FP = "cpu | Test CPU | torch 2.13.0+cpu"
MODEL = {"model_type": "llama", "params": 10, "layers": 1, "hidden": 4, "vocab": 8}


def _shape(**kw) -> TrainShape:
    base = dict(method="full", distribution="ddp", world_size=2, device="cpu", dtype="fp32",
                micro_batch=2, seq_len=64)  # fmt: skip
    return TrainShape(**{**base, **kw})


def _m(tensors: int, process: int, *, fp: str = CPU_FP, t: float = 1.0, **kw) -> Measurement:
    base = dict(fingerprint=fp, key=config_key(MODEL, _shape()), kind="live_tensor_bytes",
                estimate_tensor_bytes=tensors, estimate_peak_phase="backward",
                measured_tensor_bytes=tensors, measured_peak_phase="backward",
                process_peak_bytes=process, time=t)  # fmt: skip
    return Measurement(**{**base, **kw})


def test_fingerprints_name_the_hardware_and_torch() -> None:
    cuda = fingerprint(
        "cuda", device_names=["RTX 4090", "RTX 3090", "RTX 4090"], driver="550.54", torch="2.13.0"
    )
    assert cuda == "cuda | RTX 3090 + RTX 4090 | driver 550.54 | torch 2.13.0"
    assert fingerprint("cpu", cpu_model="Test CPU", torch="2.13.0+cpu") == CPU_FP


def test_the_file_lives_in_the_user_data_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert calibration_path() == tmp_path / "homelab-dp" / "calibration.json"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert calibration_path() == tmp_path / ".local" / "share" / "homelab-dp" / "calibration.json"


def test_store_round_trip_replaces_the_same_configuration(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    store = CalibrationStore(path)
    store.add(_m(100, 1000, t=1))
    store.add(_m(120, 1100, t=2))  # same fingerprint and key: replaces
    store.add(_m(50, 500, key=config_key(MODEL, _shape(micro_batch=1)), t=3))
    store.add(_m(70, 700, fp="cuda | X | driver 1 | torch 2", t=4))
    store.save()
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    again = CalibrationStore(path)
    assert again.problem is None
    assert [m.measured_tensor_bytes for m in again.measurements] == [120, 50, 70]
    assert again.measurements[0] == store.measurements[0]
    mine = again.for_hardware(CPU_FP, assumed_overhead("cpu"))
    assert len(mine.measurements) == 2 and mine.match(config_key(MODEL, _shape())).time == 2
    assert mine.match(config_key(MODEL, _shape(micro_batch=3))) is None
    assert again.for_hardware("nowhere", assumed_overhead("cpu")).overhead is None
    assert again.for_hardware(None, assumed_overhead("cpu")).fingerprint is None


def test_old_measurements_are_dropped(tmp_path: Path) -> None:
    store = CalibrationStore(tmp_path / "cal.json")
    for i in range(KEEP_PER_FINGERPRINT + 5):
        store.add(_m(100, 1000, key=config_key(MODEL, _shape(micro_batch=i + 1)), t=i))
    assert len(store.measurements) == KEEP_PER_FINGERPRINT
    assert min(m.time for m in store.measurements) == 5


def test_an_unreadable_file_is_reported_and_treated_as_empty(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    path.write_text("{not json", encoding="utf-8")
    store = CalibrationStore(path)
    assert store.measurements == [] and store.problem and str(path) in store.problem


def test_cpu_overhead_from_one_measurement_keeps_the_assumed_fraction() -> None:
    assumed = Overhead(700 * MiB, 0.05)
    got = corrected_overhead([_m(100 * MiB, 600 * MiB)], assumed)
    # 600 − 100 = 500 MiB beyond the tensors, of which 5% × 100 MiB is slack.
    assert got.runtime_bytes == 495 * MiB and got.fragmentation == 0.05
    assert got.source.startswith("measured") and got.fragmentation_source == "assumed"
    assert got.bytes_for(100 * MiB) == 500 * MiB  # reproduces the measured process peak


def test_cpu_overhead_fits_a_line_through_measurements_of_different_sizes() -> None:
    ms = [_m(t * MiB, (t + 400 + t // 10) * MiB, t=i) for i, t in enumerate((100, 300, 1000))]
    got = corrected_overhead(ms, Overhead(700 * MiB, 0.05))
    assert got.fragmentation == pytest.approx(0.1, abs=1e-6)
    assert got.runtime_bytes == pytest.approx(400 * MiB, abs=2)
    assert got.fragmentation_source.startswith("measured")


def test_cuda_overhead_from_reserved_and_device_use() -> None:
    fp = "cuda | X | driver 1 | torch 2"
    ms = [_m(1000, 1100, fp=fp, kind="cuda_max_allocated", runtime_bytes=600),
          _m(2000, 2400, fp=fp, kind="cuda_max_allocated", runtime_bytes=800)]  # fmt: skip
    got = corrected_overhead(ms, assumed_overhead("cuda", 2))
    assert got.fragmentation == pytest.approx((0.1 + 0.2) / 2)
    assert got.runtime_bytes == 700 and got.fragmentation_source == got.source


def test_nothing_usable_keeps_the_assumption() -> None:
    assumed = assumed_overhead("cpu")
    assert corrected_overhead([_m(100, 0)], assumed) is assumed


def _plan(calibration: HardwareCalibration | None):
    spec = spec_from_config(SMOLLM_135M)
    preset = preset_from_dict({"model": {"path": "m"}, "data": {"path": "d", "seq_len": 512},
                               "train": {"micro_batch": 2, "grad_accum": 1}})  # fmt: skip
    hw = parse_gpus_spec("cpu:2:64GiB", 64 * GiB)
    return spec, preset, hw, plan(spec, preset, hw, calibration)


def test_plan_without_measurements_says_everything_is_assumed_or_estimated() -> None:
    *_, p = _plan(HardwareCalibration(CPU_FP))
    j = p.to_json()
    cal = j["calibration"]
    assert cal["fingerprint"] == CPU_FP and cal["measured"] is None
    assert cal["sources"]["overhead"] == "assumed" and cal["sources"]["tensors"] == "estimate"
    assert all("(assumed)" in a for a in j["assumptions"])
    assert p.chosen.budget.overhead == int(
        assumed_overhead("cpu").bytes_for(p.chosen.budget.tensors)
    )


def test_plan_shows_the_measured_figure_and_uses_the_measured_overhead() -> None:
    spec, preset, hw, first = _plan(None)
    key = measurement_key(spec, preset, hw, first.chosen)
    est = first.chosen.budget.tensors
    m = _m(est, est + 300 * MiB, key=key, measured_tensor_bytes=int(est * 1.04))
    ov = corrected_overhead([m], assumed_overhead("cpu"))
    *_, p = _plan(HardwareCalibration(CPU_FP, (m,), ov))
    b = p.chosen.budget
    assert b.overhead == int(ov.runtime_bytes + ov.fragmentation * b.tensors)
    j = p.to_json()
    cal = j["calibration"]
    assert cal["measured"]["tensor_bytes"] == int(est * 1.04)
    assert cal["measured"]["error"] == pytest.approx(est / int(est * 1.04) - 1)
    assert cal["sources"]["overhead"] == "measured" and cal["sources"]["tensors"] == "measured"
    assert cal["overhead"]["runtime_bytes"] == ov.runtime_bytes
    assert any(a.startswith("Python/torch runtime") and "measured" in a for a in j["assumptions"])
    assert any(r.startswith("Measured on this hardware") and "-3.8%" in r for r in j["reasons"])
    json.dumps(j)  # the whole document stays JSON


def test_measurements_of_other_configurations_still_correct_the_overhead() -> None:
    m = _m(10**8, 10**9, key=config_key(MODEL, _shape(micro_batch=7)))
    ov = corrected_overhead([m], assumed_overhead("cpu"))
    *_, p = _plan(HardwareCalibration(CPU_FP, (m,), ov))
    assert p.to_json()["calibration"]["measured"] is None
    assert any("1 measurement(s) on this hardware" in r for r in p.reasons)
    assert p.chosen.budget.overhead == int(ov.bytes_for(p.chosen.budget.tensors))
