"""A flood of run events and the latency of keys meanwhile: shared by ``test_follow.py`` and
``benchmarks/tui_latency.py`` (the benchmark reports the figures the test only guards)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from homelab_dp.tui.tui_app import HomelabApp

KEY_LIVENESS_S = 10.0
"""Liveness guard on one key press: a key unanswered this long means the UI is stuck. Not a
latency target: ``python benchmarks/tui_latency.py`` measured a median of 0.98 s idle and 2.9 s
while 500 events a second arrive, 5.0 s at the most, on the 2-core development machine at load
average 17 (docs/benchmarks.md, "TUI key latency", 2026-12-05)."""

SWITCHES = (("5", "runs"), ("4", "monitor"))
"""Key presses that switch screens and the mode each one leads to (Runs, then back)."""


async def key_latency(app: HomelabApp, key: str, mode: str, limit: float = KEY_LIVENESS_S) -> float:
    """Seconds from a key press to its effect. (Pilot.press waits for the CPU to go idle,
    which it does not while events pour in, so it would measure the load, not the UI.)"""
    started = time.perf_counter()
    app.simulate_key(key)
    while app.current_mode != mode:
        await asyncio.sleep(0.002)
        assert time.perf_counter() - started < limit, f"key {key} not handled in {limit} s"
    return time.perf_counter() - started


def thousand_events(run_id: str) -> list[dict[str, Any]]:
    """A start event, then 333 optimizer steps of two micro-steps each: 1000 events."""
    t = 1740830000.0
    out: list[dict[str, Any]] = [
        {"type": "start", "time": t, "run_id": run_id, "method": "full", "distribution": "ddp",
         "total_steps": 333, "world_size": 2, "micro_batch": 4, "grad_accum": 2,
         "effective_batch": 16}
    ]  # fmt: skip
    step = 0
    while len(out) < 1000:
        step += 1
        for k in (1, 2):
            out.append({"type": "micro", "time": t, "step": step, "micro_step": k, "grad_accum": 2})
        t += 0.5
        out.append(
            {"type": "step", "time": t, "step": step * 3 - 1, "loss": 3.0 / (1 + step / 50),
             "lr": 1e-4, "tokens_per_s": 8000.0 + step, "step_time_s": 0.5,
             "rank_step_times_s": [0.5, 0.5], "micro_batch": 4, "grad_accum": 2,
             "world_size": 2, "effective_batch": 16}
        )  # fmt: skip
    return out


def write_slowly(path: Path, events: list[dict[str, Any]], per_s: float = 500.0) -> None:
    """Append in chunks of 10 lines at ``per_s`` events a second, as rank 0 would."""
    with open(path, "a", encoding="utf-8") as fh:
        for i in range(0, len(events), 10):
            fh.writelines(json.dumps(e) + "\n" for e in events[i : i + 10])
            fh.flush()
            time.sleep(10 / per_s)
