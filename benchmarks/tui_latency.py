"""Key latency of the TUI: idle, and while 1000 run events arrive at 500 a second.

    python benchmarks/tui_latency.py [--floods 5] [--idle-presses 100]

The mechanism of `tests/tui/test_follow.py::test_every_event_is_folded_and_every_key_answered_while_1000_events_arrive`
(`tests/tui/flood.py`): HomelabApp under Textual's Pilot (``run_test``) follows a copy of the
recorded run, marked running; a writer thread appends events as rank 0 would, and each
measurement is one ``app.simulate_key`` that switches screens (5 → Runs, 4 → Monitor), timed
until ``app.current_mode`` shows its effect. Prints a markdown table of median, p95 and max.

The test only guards liveness (`tests/tui/flood.py::KEY_LIVENESS_S`); this reports the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the shared test mechanism lives in tests/

from homelab_dp.app.runs import RunController  # noqa: E402
from tests.tui.conftest import copy_run, has_snapshot  # noqa: E402
from tests.tui.flood import SWITCHES, key_latency, thousand_events, write_slowly  # noqa: E402

FOLLOW_INTERVAL_S = 0.01  # as in the test: the follower polls the run folder 100 times a second


async def measure(root: Path, name: str, flood: bool, presses: int) -> tuple[list[float], int]:
    """Key latencies (seconds) in one app session, and the events the app had folded."""
    from homelab_dp.tui.tui_app import HomelabApp

    run_dir = copy_run(root, name, status="running", events=False, pids={"keeper": os.getpid()})
    app = HomelabApp(
        RunController(root), mode="monitor", follow=run_dir.name, follow_interval=FOLLOW_INTERVAL_S
    )
    latencies: list[float] = []
    async with app.run_test() as pilot:
        while not has_snapshot(app):
            await pilot.pause(0.05)
        if flood:
            events = thousand_events(run_dir.name)
            writer = threading.Thread(target=write_slowly, args=(run_dir / "events.jsonl", events))
            writer.start()
            while writer.is_alive():
                for key, mode in SWITCHES:
                    latencies.append(await key_latency(app, key, mode))
            writer.join()
        else:
            while len(latencies) < presses:
                for key, mode in SWITCHES:
                    latencies.append(await key_latency(app, key, mode))
                    await asyncio.sleep(0.01)  # a person does not press keys back to back
        seen = app.snapshot.view.events_seen if app.snapshot else 0
    return latencies, seen


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floods", type=int, default=5, help="flooded sessions (1000 events each)")
    parser.add_argument("--idle-presses", type=int, default=100)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        idle, _ = asyncio.run(measure(root, "idle-0000", False, args.idle_presses))
        rows.append(("idle (no events arriving)", 1, idle))
        flooded: list[float] = []
        for i in range(args.floods):
            latencies, _ = asyncio.run(measure(root, f"flood-{i:04d}", True, 0))
            flooded += latencies
        rows.append(("1000 events at 500/s", args.floods, flooded))
    load = os.getloadavg()
    print(f"Key latency of the TUI (screen switch), {os.cpu_count()} CPUs, load average "
          f"{load[0]:.1f} at the end\n")  # fmt: skip
    print("| condition | sessions | presses | median ms | p95 ms | max ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, sessions, values in rows:
        print(
            f"| {label} | {sessions} | {len(values)} | {statistics.median(values) * 1000:.0f} "
            f"| {p95(values) * 1000:.0f} | {max(values) * 1000:.0f} |"
        )


if __name__ == "__main__":
    main()
