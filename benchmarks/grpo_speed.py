"""GRPO's speed on the CPU: tokens generated a second and optimizer steps a minute of the
tiny-grpo preset on 1 and 2 processes, each beside the plan's prediction.

    python benchmarks/grpo_speed.py [--processes 1,2] [--steps 20] [--json]

Each run is real, through the console script: ``homelab-dp run presets/tiny-grpo.toml --gpus
cpu:N --json`` in a temporary runs folder, with a temporary ``XDG_DATA_HOME`` (so the plan
prices compute at the stated defaults, not at what earlier runs on this machine recorded);
the prediction is ``homelab-dp plan presets/tiny-grpo.toml --gpus cpu:N --json`` in the same
environment (`homelab_dp.planning.grpo_plan`: generation; `homelab_dp.planning.time_model`:
training).

From the step events (the first step left out: warm-up):

- **generated tokens/s**: the completions' tokens of every rank (``completion_length`` ×
  completions of the step) ÷ the step's ``generation_s`` (rank 0's: the ranks generate at
  once), summed over the steps. The plan's figure is at full length
  (``max_completion_tokens`` every completion); the preset's reward shortens them, so the
  measured completions are shorter and a group stops decoding when its longest ends (the
  table gives the mean length).
- **decode ms/step**: ``generation_s`` ÷ (groups a rank decodes × the step's longest
  completion): each group decodes for its longest completion, so this is a lower bound of a
  decode step's time, beside the plan's (`GrpoTime.seconds_per_decode_step`).
- **steps/min**: optimizer steps a minute from the first step event's time to the last.
- **generation share**: Σ ``generation_s`` ÷ Σ ``step_time_s``.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "presets" / "tiny-grpo.toml"
EXE = [sys.executable, "-m", "homelab_dp.cli"]


def summarize(events: list[dict[str, Any]], generations: int, skip: int = 1) -> dict[str, Any]:
    """The measured figures of one run from its ``step`` events (the first ``skip`` left
    out)."""
    steps = [e for e in events if e.get("type") == "step"]
    use = steps[skip:]
    if len(use) < 2:
        raise ValueError(f"{len(steps)} step events: too few to time (need {skip + 2})")
    tokens = gen_s = step_s = decode_steps = 0.0
    for e in use:
        completions = e["effective_batch"] * generations
        tokens += e["completion_length"] * completions
        gen_s += e["generation_s"]
        step_s += e["step_time_s"]
        groups = e["effective_batch"] / e["world_size"]
        decode_steps += groups * e["completion_length_max"]
    span = use[-1]["time"] - use[0]["time"]
    return {
        "steps": len(use),
        "generated_tokens_per_s": tokens / gen_s if gen_s else 0.0,
        "decode_ms_per_step": 1e3 * gen_s / decode_steps if decode_steps else 0.0,
        "steps_per_min": 60.0 * (len(use) - 1) / span if span > 0 else 0.0,
        "generation_share": gen_s / step_s if step_s else 0.0,
        "completion_length": tokens / sum(e["effective_batch"] * generations for e in use),
        "reward_first": steps[0].get("reward"),
        "reward_last": steps[-1].get("reward"),
    }


def predicted(plan_doc: dict[str, Any]) -> dict[str, Any]:
    """The plan's figures for the same columns."""
    pred = plan_doc["predicted"]
    grpo = plan_doc["grpo"]
    return {
        "generated_tokens_per_s": pred["generated_tokens_per_s"],
        "steps_per_min": 60.0 / pred["step_seconds"],
        "generation_share": pred["generation_share"],
        "decode_ms_per_step": 1e3 * pred["generation_decode_step_seconds"],
        "engine": grpo["engine"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table: per process count the measured figures and the plan's beside them."""
    head = ("| processes | generated tokens/s (plan, full length) | decode ms/step (plan) | "
            "steps/min (plan) | generation share (plan) | mean completion (tokens) |")  # fmt: skip
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        m, p = r["measured"], r["predicted"]
        lines.append(
            f"| {r['processes']} | {m['generated_tokens_per_s']:,.0f} "
            f"({p['generated_tokens_per_s']:,.0f}) | {m['decode_ms_per_step']:.1f} "
            f"({p['decode_ms_per_step']:.1f}) | {m['steps_per_min']:,.0f} "
            f"({p['steps_per_min']:,.0f}) | {m['generation_share']:.0%} "
            f"({p['generation_share']:.0%}) | {m['completion_length']:.1f} |"
        )
    return "\n".join(lines)


def _run(args: list[str], env: dict[str, str], timeout: float) -> str:
    done = subprocess.run([*EXE, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False, cwd=ROOT)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout


def measure(processes: int, steps: int, tmp: Path) -> dict[str, Any]:
    """One real run of the preset on ``processes`` CPU processes and its plan."""
    env = {**os.environ, "XDG_DATA_HOME": str(tmp / "data"), "PYTHONPATH": str(ROOT)}
    common = ["--gpus", f"cpu:{processes}", "--set", f"train.max_steps={steps}"]
    plan_doc = json.loads(_run(["plan", str(PRESET), *common, "--json"], env, 600))
    out = _run(["run", str(PRESET), *common, "--json", "--runs", str(tmp / f"runs{processes}")],
               env, 1800)  # fmt: skip
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    generations = _generations()
    return {"processes": processes, "measured": summarize(events, generations),
            "predicted": predicted(plan_doc)}  # fmt: skip


def _generations() -> int:
    import tomllib

    return int(tomllib.loads(PRESET.read_text())["grpo"]["generations"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", default="1,2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="grpo-speed-") as d:
        for n in (int(x) for x in args.processes.split(",")):
            rows.append(measure(n, args.steps, Path(d)))
    if args.json:
        print(json.dumps(rows, indent=1))
    print(f"python benchmarks/grpo_speed.py --processes {args.processes} --steps {args.steps}"
          f"  ({time.strftime('%Y-%m-%d', time.gmtime())}, {os.cpu_count()} cores)")  # fmt: skip
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
