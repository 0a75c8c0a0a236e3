"""Presets that remember: the expectation math, fingerprint matching, the store, and what `plan`
and `presets show` make of recorded runs (no run here: tests/integration/test_controller.py
records real ones)."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from homelab_dp.app.plan import make_plan
from homelab_dp.cli.main import main
from homelab_dp.presets.preset_store import open_preset
from homelab_dp.render.preset_results import about, expected_text, results_lines
from homelab_dp.runs.preset_results import (
    append_result,
    device_names,
    expect,
    expected_runs,
    preset_runs,
    read_results,
    results_path,
    run_fingerprint,
    run_results_path,
    save_results,
    speed_fingerprint,
)
from homelab_dp.runs.run_spec import Launch, Resolved, RunSpec

FP = {"world_size": 2, "devices": ["NVIDIA A10", "NVIDIA A10"], "micro_batch": 4}


def rec(tps: float, wall: float, energy: float = 0.0, **kw: Any) -> dict[str, Any]:
    """A record of 10 steps of 100 tokens each (1,000 tokens)."""
    base = {"preset": "p", "run_id": f"r{tps:g}", "fingerprint": FP, "tokens_per_s": tps,
            "tokens": 1000, "steps": 10, "total_steps": 10, "wall_s": wall, "energy_wh": energy,
            "launches": 1, "queued_s": 0.0, "time": 0.0}  # fmt: skip
    return {**base, **kw}


def test_expected_duration_and_energy_are_medians_scaled_to_the_planned_tokens() -> None:
    # tokens / tokens/s = 10, 5, 4 s; walls 15, 9, 7: fixed time 5, 4, 3 s (median 4).
    runs = [rec(100, 15, energy=1.0), rec(200, 9, energy=3.0), rec(250, 7)]
    e = expect(runs, planned_steps=20)
    assert e is not None and e.from_runs == 3 and e.tokens_per_s == 200
    assert (e.steps, e.steps_from, e.tokens, e.fixed_s) == (20, "preset", 2000, 4.0)
    assert e.duration_s == pytest.approx(4.0 + 2000 / 200)
    # Energy per token: 0.001 and 0.003 Wh (the third run measured none) → 0.002 × 2,000.
    assert e.energy_wh == pytest.approx(4.0)
    assert e.to_json()["run_ids"] == ["r100", "r200", "r250"]


def test_queue_waits_and_resumed_runs_do_not_count_as_fixed_time_and_epochs_use_the_runs_steps():
    runs = [rec(100, 40, queued_s=28), rec(100, 500, launches=2, total_steps=30)]
    e = expect(runs, planned_steps=None)
    assert e is not None and e.fixed_s == 2.0  # 40 - 28 queued - 10 training; the resumed: not
    assert (e.steps, e.steps_from) == (20, "recorded runs")  # median of 10 and 30 planned
    assert e.duration_s == pytest.approx(2.0 + 2000 / 100) and e.energy_wh is None
    assert expect([rec(100, 9, tokens_per_s=None)], 20) is None  # no speed measured


def test_only_runs_of_the_same_preset_and_fingerprint_give_an_expectation() -> None:
    other = {**FP, "world_size": 1, "devices": ["NVIDIA A10"]}
    records = [rec(100, 15), rec(300, 9, fingerprint=other, time=5.0), rec(900, 9, preset="q")]
    found = preset_runs("p", records, FP, 10)
    assert (len(found.same), len(found.other)) == (1, 1) and found.expectation is not None
    assert found.expectation.tokens_per_s == 100  # not the other hardware's, not preset q's
    alone = preset_runs("p", records[1:], FP, 10)
    assert alone.expectation is None and alone.to_json()["expected"] is None
    assert alone.differences == ("devices 1× NVIDIA A10 (this plan 2× NVIDIA A10)",
                                 "world_size 1 (this plan 2)")  # fmt: skip
    assert alone.to_json()["recorded_runs"] == {"preset": "p", "same_settings": 0,
        "other_settings": 1, "differences": list(alone.differences)}  # fmt: skip
    text = expected_text(alone)
    assert text is not None and "nothing yet — 1 recorded run(s) of p ran on other" in text.plain
    assert "world_size 1 (this plan 2)" in text.plain
    assert expected_text(preset_runs("p", [], FP, 10)) is None  # nothing recorded: no line
    shown = expected_text(found)
    assert shown is not None and shown.plain.startswith("expected: ~15 s, energy not measured")
    assert "from 1 run on these devices and settings, median 100 tokens/s" in shown.plain
    assert [about(s) for s in (42, 100, 725, 7500)] == ["~42 s", "~1 min 40 s", "~12 min",
                                                         "~2 h 05 min"]  # fmt: skip


def test_a_run_and_a_plan_of_the_same_preset_have_the_same_fingerprint(in_repo: Path) -> None:
    planned = make_plan(open_preset("tiny-demo"))
    doc = planned.plan.to_json()
    names = [d.name for d in planned.hardware.devices]
    fp = speed_fingerprint(doc, planned.preset, device_names("cpu", names, planned.report))
    t = doc["training"]
    resolved = Resolved(doc["method"], doc["distribution"], t["activation_checkpointing"], "cpu",
                        t["world_size"], t["dtype"], t["micro_batch"], t["grad_accum"], 3e-3)  # fmt: skip
    spec = RunSpec("r", planned.preset, resolved, Launch(t["world_size"]), plan=doc)
    assert run_fingerprint(spec) == fp and fp["world_size"] == 2 and fp["packed"] is True
    assert len(fp["devices"]) == 2 and "cpu process" not in fp["devices"][0]  # the CPU model
    # An out-of-memory retry ran another batch split: another fingerprint.
    retried = spec.with_batch(t["micro_batch"] // 2, t["grad_accum"] * 2, False)
    assert run_fingerprint(retried)["micro_batch"] == t["micro_batch"] // 2
    assert expected_runs(replace(planned, preset=replace(planned.preset, source=""))) is None


def test_the_store_records_a_run_once_and_skips_torn_lines(tmp_path: Path) -> None:
    record = rec(100, 15)
    assert save_results(tmp_path, record) is True
    assert save_results(tmp_path, {**record, "run_id": "again"}) is False  # recorded before
    assert json.loads(run_results_path(tmp_path).read_text(encoding="utf-8")) == record
    with open(results_path(), "a", encoding="utf-8") as fh:
        fh.write('{"preset": "p", "torn')
    append_result(rec(200, 9, preset="q"))  # after a torn line: its own line still reads
    assert [r["run_id"] for r in read_results()] == ["r100"]  # the torn line swallowed q's
    assert read_results("q") == [] and read_results("p") == [record]
    assert stat.S_IMODE(os.stat(results_path()).st_mode) == 0o600


def test_plan_and_presets_show_of_a_preset_with_recorded_runs(in_repo: Path, capsys) -> None:
    planned = make_plan(open_preset("tiny-demo"))
    names = [d.name for d in planned.hardware.devices]
    fp = speed_fingerprint(
        planned.plan.to_json(), planned.preset, device_names("cpu", names, planned.report)
    )
    # 10 steps of 2,000 tokens at 1,000 tokens/s in 30 s: 10 s fixed; 60 steps: 120 s + 10 s.
    append_result(rec(1000, 30, preset="tiny-demo", fingerprint=fp, tokens=20_000, steps=10,
                      total_steps=60, energy_wh=5.0, final_loss=1.25, eval_loss=1.5,
                      peak_memory_bytes=[3 << 20, 4 << 20], mfu=None))  # fmt: skip
    assert main(["plan", "tiny-demo", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["expected"]["from_runs"] == 1 and doc["expected"]["tokens"] == 120_000
    assert doc["expected"]["duration_s"] == pytest.approx(10 + 120)
    assert doc["expected"]["energy_wh"] == pytest.approx(30.0)
    assert doc["recorded_runs"]["same_settings"] == 1 and "fits" in doc  # the plan's keys stay
    assert main(["plan", "tiny-demo"]) == 0
    assert "expected: ~2 min 10 s, ~30.0 Wh (from 1 run" in capsys.readouterr().out
    assert main(["plan", "tiny-demo", "--set", "train.micro_batch=2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["expected"] is None and doc["recorded_runs"]["other_settings"] == 1

    assert main(["presets", "show", "tiny-demo", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["name"] == "tiny-demo" and [r["run_id"] for r in shown["results"]] == ["r1000"]
    assert main(["presets", "show", "tiny-demo"]) == 0
    out = capsys.readouterr().out
    assert "# Results of completed runs of tiny-demo (1)" in out
    row = next(line for line in out.splitlines() if " r1000 " in line)
    assert row.split()[3:] == ["2×", *fp["devices"][0].split(), "4×2×2", "@256", "1,000", "n/a",
                               "4.00", "MiB", "5.0", "Wh", "30s", "10/60", "1.2500", "1.5000"]  # fmt: skip


def test_results_table_without_records_says_what_is_recorded() -> None:
    assert "failed and interrupted runs are not recorded" in results_lines([])[0]
