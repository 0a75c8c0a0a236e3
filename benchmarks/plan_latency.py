"""Wall time of `homelab-dp plan` and `probe` in fresh processes (median of N runs).

python benchmarks/plan_latency.py [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "plan tiny-demo --json": ["plan", "tiny-demo", "--json"],
    "plan llama3-8b-qlora-2x24gb --gpus 2x24GiB": [
        "plan",
        "llama3-8b-qlora-2x24gb",
        "--gpus",
        "2x24GiB",
    ],
    "probe --json": ["probe", "--json"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    exe = Path(sys.executable).with_name("homelab-dp")
    print(f"{'command':<48} {'median s':>9} {'min s':>7} {'max s':>7}")
    for label, argv in COMMANDS.items():
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            subprocess.run([str(exe), *argv], cwd=ROOT, check=True, capture_output=True)
            times.append(time.perf_counter() - start)
        print(
            f"homelab-dp {label:<37} {statistics.median(times):>9.3f} {min(times):>7.3f} {max(times):>7.3f}"
        )


if __name__ == "__main__":
    main()
