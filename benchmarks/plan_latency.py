"""Wall time of `homelab-dp plan` and `probe` in fresh processes, and of one `probe()` call.

python benchmarks/plan_latency.py [--runs 5]

Prints a markdown table (median, min, max of N runs). The last row is what
`tests/unit/probe/test_probe.py::test_real_pynvml_without_a_driver_is_fast_and_says_why` times: the
first `probe()` of a fresh process against the real pynvml (importing pynvml, looking for the
driver, reading the host), `homelab_dp.probe.nvml` already imported; the test bounds it only by
a liveness guard (``PROBE_LIVENESS_S``) many times this figure.
"""

from __future__ import annotations

import argparse
import os
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
PROBE_CALL = (
    "import time\n"
    "from homelab_dp.probe.nvml import probe\n"
    "started = time.perf_counter()\n"
    "probe()\n"
    "print(time.perf_counter() - started)\n"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    exe = Path(sys.executable).with_name("homelab-dp")
    env = {k: v for k, v in os.environ.items() if k != "HOMELAB_DP_FAKE_NVML"}  # the real pynvml
    rows = []
    for label, argv in COMMANDS.items():
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            subprocess.run([str(exe), *argv], cwd=ROOT, env=env, check=True, capture_output=True)
            times.append(time.perf_counter() - start)
        rows.append((f"`homelab-dp {label}` (fresh process)", times))
    calls = []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", PROBE_CALL], cwd=ROOT, env=env, check=True,
                             capture_output=True, text=True)  # fmt: skip
        calls.append(float(out.stdout))
    rows.append(("first `probe()` call in a process (real pynvml)", calls))
    load = os.getloadavg()[0]
    print(f"{args.runs} runs each, {os.cpu_count()} CPUs, load average {load:.1f} at the end\n")
    print("| what | median s | min s | max s |")
    print("|---|---:|---:|---:|")
    for label, times in rows:
        print(f"| {label} | {statistics.median(times):.3f} | {min(times):.3f} | {max(times):.3f} |")


if __name__ == "__main__":
    main()
