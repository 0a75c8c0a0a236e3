"""benchmarks/grpo_speed.py: its figures from step events and its table (no timed run here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("grpo_speed", ROOT / "benchmarks" / "grpo_speed.py")
assert _spec and _spec.loader
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _step(t: float, gen_s: float, step_s: float, length: float, longest: float) -> dict:
    return {"type": "step", "time": t, "generation_s": gen_s, "step_time_s": step_s,
            "completion_length": length, "completion_length_max": longest,
            "effective_batch": 4, "world_size": 2, "reward": t}  # fmt: skip


def test_the_figures_come_from_the_step_events_after_the_first() -> None:
    events = [
        {"type": "start", "time": 0.0},
        _step(1.0, 9.0, 9.5, 16.0, 16.0),  # warm-up: left out
        _step(2.0, 0.2, 0.5, 5.0, 8.0),
        {"type": "devices", "time": 2.5},
        _step(3.0, 0.3, 0.5, 10.0, 16.0),
        _step(5.0, 0.5, 1.0, 6.0, 8.0),
    ]
    got = bench.summarize(events, generations=4)
    # completions per step: 4 prompts × 4 generations; tokens 16 × (5 + 10 + 6) over 1.0 s
    assert got["generated_tokens_per_s"] == pytest.approx(16 * 21 / 1.0)
    # each rank decodes 2 groups a step, each for the step's longest completion at most
    assert got["decode_ms_per_step"] == pytest.approx(1e3 * 1.0 / (2 * 8 + 2 * 16 + 2 * 8))
    assert got["steps_per_min"] == pytest.approx(60 * 2 / 3.0)  # 2 intervals in 3 s
    assert got["generation_share"] == pytest.approx(1.0 / 2.0)
    assert got["completion_length"] == pytest.approx(21 / 3)
    assert (got["reward_first"], got["reward_last"]) == (1.0, 5.0)
    with pytest.raises(ValueError, match="too few"):
        bench.summarize(events[:3], generations=4)


def test_the_table_puts_the_plan_beside_each_measurement() -> None:
    row = {"processes": 2,
           "measured": {"generated_tokens_per_s": 1234.4, "decode_ms_per_step": 7.71,
                        "steps_per_min": 73.2, "generation_share": 0.581,
                        "completion_length": 5.17},
           "predicted": {"generated_tokens_per_s": 624.2, "decode_ms_per_step": 8.0,
                         "steps_per_min": 65.3, "generation_share": 0.446}}  # fmt: skip
    lines = bench.table([row]).splitlines()
    assert lines[0].startswith("| processes | generated tokens/s (plan, full length) |")
    assert lines[2] == "| 2 | 1,234 (624) | 7.7 (8.0) | 73 (65) | 58% (45%) | 5.2 |"
