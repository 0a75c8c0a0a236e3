"""End to end through the console script: `homelab-dp run tiny-demo`, `stop`, and how soon a
run ends after a fault.

    python benchmarks/run_e2e.py [--steps 10] [--no-faults]

Every run is the shipped tiny-demo preset (2 CPU processes, gloo) in a temporary runs folder
(``HOMELAB_DP_RUNS``), one after another. Prints a markdown table of seconds:

  run (whole command)     `homelab-dp run tiny-demo --set train.max_steps=N --json`, start to exit
  first step event        from the same command's start to its first ``step`` line
  stop (the command)      `homelab-dp stop RUN` on a detached run past step 2, start to exit
  fault → final state     an injected fault (``HOMELAB_DP_FAULT``, `homelab_dp.train.loop.rank_guard`) on
                          rank 1 at step 3, from the moment it fired to the final state written:
                          SIGKILL (a crash), SIGSTOP (a hang; ``train.watchdog_s = 4``), out of
                          memory — what `tests/integration/test_faults.py` guards
  processes gone          for each run, from its final state being written to no process
                          recorded in state.json being alive (an upper bound: polled, and for
                          the first run only once its command has exited)

The tests' wall-time bounds are liveness guards many times these figures; this reports them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from homelab_dp.runs.folder.run_state import ACTIVE, alive_pids, current_state, read_state

EXE = Path(sys.executable).with_name("homelab-dp")
ROOT = Path(__file__).resolve().parents[1]
WATCHDOG_S = 4
FAULTS = {  # label -> (HOMELAB_DP_FAULT, extra --set)
    "SIGKILL one rank → final state": ("sigkill:rank=1:step=3", []),
    f"SIGSTOP one rank → final state (watchdog_s = {WATCHDOG_S})": (
        "sigstop:rank=1:step=3",
        [f"train.watchdog_s={WATCHDOG_S}"],
    ),
    "out of memory on one rank → final state": ("oom:rank=1:step=3", []),
}


def sets(*overrides: str) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def wait(condition, timeout: float, what: str, poll: float = 0.02):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise SystemExit(f"timed out after {timeout} s waiting for {what}")


def ended(run_dir: Path) -> dict:
    """The final state, once written."""
    return wait(lambda: (s := current_state(run_dir)).get("status") not in ACTIVE and s,
                600, f"{run_dir.name} to end")  # fmt: skip


def gone_after_end(run_dir: Path) -> float:
    """Seconds from the final state being written to no recorded process alive."""
    state = ended(run_dir)
    wait(lambda: not alive_pids(read_state(run_dir)), 120, f"{run_dir.name}'s processes to exit")
    return time.time() - state["ended"]


def steps_seen(run_dir: Path) -> int:
    path = run_dir / "events.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return max((json.loads(x)["step"] for x in lines if '"type": "step"' in x), default=0)


def start_detached(env: dict[str, str], *overrides: str) -> str:
    out = subprocess.run([str(EXE), "run", "tiny-demo", *sets(*overrides), "--detach", "--json"],
                         env=env, cwd=ROOT, capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])["run_id"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="train.max_steps of the whole run")
    parser.add_argument("--no-faults", action="store_true", help="skip the three fault runs")
    args = parser.parse_args()
    rows: list[tuple[str, float, float | None]] = []  # (what, seconds, processes gone)
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp) / "runs"
        env = {**os.environ, "HOMELAB_DP_RUNS": str(runs), "XDG_DATA_HOME": str(runs.parent)}
        env.pop("HOMELAB_DP_FAULT", None)

        started = time.perf_counter()
        proc = subprocess.Popen(
            [str(EXE), "run", "tiny-demo", *sets(f"train.max_steps={args.steps}"), "--json"],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert proc.stdout is not None
        first_step, run_id = None, None
        for line in proc.stdout:
            event = json.loads(line)
            run_id = run_id or event.get("run_id")
            if event.get("type") == "step" and first_step is None:
                first_step = time.perf_counter() - started
        assert proc.wait() == 0, "the run failed"
        took = time.perf_counter() - started
        assert run_id is not None
        rows.append((f"`run tiny-demo --set train.max_steps={args.steps}` (whole command)", took,
                     gone_after_end(runs / run_id)))  # fmt: skip
        rows.append(("… its first step event, from the command's start", first_step or 0.0, None))

        run_id = start_detached(env, "train.max_steps=100000", "train.checkpoint_every=0")
        wait(lambda: steps_seen(runs / run_id) >= 2, 300, "step 2", poll=0.1)
        started = time.perf_counter()
        subprocess.run([str(EXE), "stop", run_id], env=env, check=True, capture_output=True)
        took = time.perf_counter() - started
        rows.append(
            ("`stop RUN` (the command, run past step 2)", took, gone_after_end(runs / run_id))
        )

        for label, (fault, overrides) in ({} if args.no_faults else FAULTS).items():
            run_id = start_detached({**env, "HOMELAB_DP_FAULT": fault}, "train.max_steps=8",
                                    "train.checkpoint_every=0", *overrides)  # fmt: skip
            run_dir = runs / run_id
            state = ended(run_dir)
            kind, rank, step = fault.split(":")
            marker = run_dir / "logs" / f"fault-{kind}-rank{rank[5:]}-step{step[5:]}"
            took = state["ended"] - marker.stat().st_mtime
            rows.append((f"{label} ({state['status']})", took, gone_after_end(run_dir)))
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end\n")
    print("| what | seconds | processes gone, s after the final state |")
    print("|---|---:|---:|")
    for label, seconds, gone in rows:
        print(f"| {label} | {seconds:.2f} | {'' if gone is None else f'{gone:.2f}'} |")


if __name__ == "__main__":
    main()
