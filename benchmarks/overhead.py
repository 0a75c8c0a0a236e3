"""What the device monitor and the per-step event writing cost the demo's throughput.

    python benchmarks/overhead.py [--steps 40] [--repeats 2]

Runs the tiny demo (2 CPU processes) three ways, interleaved, and prints tokens/s measured
the same way for all three (tokens of the optimizer steps ÷ the worker's own training time):

  full         through the controller: keeper + device monitor (1 sample/s) + a step event
               every step — what `homelab-dp run tiny-demo` does
  no-monitor   torchrun directly (no keeper, no monitor), a step event every step
  no-events    torchrun directly, step events off (only start and end)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from homelab_dp.app.runs import make_controller
from homelab_dp.runs.folder.jsonl_tail import read_all
from homelab_dp.runs.folder.run_folder import create_run_dir, new_run_id
from homelab_dp.runs.folder.run_state import ACTIVE, current_state
from homelab_dp.supervise.launcher import run_foreground

ROOT = Path(__file__).resolve().parents[1]


def tokens_per_s(run_dir: Path) -> float:
    events = list(read_all(run_dir / "events.jsonl"))
    start = next(e for e in events if e["type"] == "start")
    end = next(e for e in events if e["type"] == "end")
    return start["tokens_per_step"] * end["steps"] / end["seconds"]


def run_full(root: Path, overrides: list[str]) -> float:
    controller = make_controller(root)
    run_id = controller.start(
        controller.prepare(str(ROOT / "presets" / "tiny-demo.toml"), overrides=overrides)
    )
    run_dir = controller.run_dir(run_id)
    while current_state(run_dir).get("status") in ACTIVE:
        time.sleep(0.5)
    return tokens_per_s(run_dir)


def run_direct(root: Path, overrides: list[str]) -> float:
    controller = make_controller(root)
    prepared = controller.prepare(str(ROOT / "presets" / "tiny-demo.toml"), overrides=overrides)
    run_dir = create_run_dir(prepared.run_spec(new_run_id("bench")), root)
    rc = run_foreground(run_dir)
    assert rc == 0, f"run failed: see {run_dir / 'logs'}"
    return tokens_per_s(run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    base = [f"train.max_steps={args.steps}", "train.checkpoint_every=0"]
    configs = {
        "full": (run_full, base),
        "no-monitor": (run_direct, base),
        "no-events": (run_direct, [*base, "train.log_every=100000"]),
    }
    results: dict[str, list[float]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HOMELAB_DP_RUNS"] = tmp
        os.environ["XDG_DATA_HOME"] = tmp  # its runs stay out of the user's run index
        for _ in range(args.repeats):
            for name, (fn, overrides) in configs.items():
                results[name].append(fn(Path(tmp), overrides))
    ref = statistics.median(results["no-events"])
    print(f"{'configuration':<14} {'tokens/s (median)':>18} {'runs':>24} {'vs no-events':>13}")
    for name, values in results.items():
        med = statistics.median(values)
        runs = ", ".join(f"{v:,.0f}" for v in values)
        print(f"{name:<14} {med:>18,.0f} {runs:>24} {med / ref:>12.1%}")
    print(json.dumps({k: statistics.median(v) for k, v in results.items()}))


if __name__ == "__main__":
    main()
