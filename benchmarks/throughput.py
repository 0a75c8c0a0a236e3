"""Worker throughput against a minimal hand-written torchrun DDP loop (target: at least 97%).

    python benchmarks/throughput.py [--steps 40] [--warmup 5] [--repeats 3] [--nproc 1 2]

Both run the demo model (assets/models/tiny-llama) on the same packed demo text, with the same
micro-batch, accumulation, steps, AdamW and clipping, on the CPU with gloo and the same
OMP_NUM_THREADS (cores / processes). The worker runs as in production: started by the launcher,
full DDP (none on one process), a step event every step (one all-gather), its chunked loss
head and its asynchronous stop vote, against the plain loop's full logits and DDP wrapper; its
end-of-run checkpoint and result saving fall outside the timed steps, as does start-up.

Each step is timed end to end (end of the previous step to the end of this one: for the worker,
the gaps between its step events, so its all-reduce, all-gather and event writing are inside);
a run's figure is the median over its steps after the warm-up of tokens / step time, which a
busy neighbour on a shared machine disturbs far less than a total; the best of ``--repeats``
interleaved runs counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from homelab_dp.presets.preset import preset_from_dict  # noqa: E402
from homelab_dp.runs.folder.run_folder import create_run_dir  # noqa: E402
from homelab_dp.runs.run_spec import Launch, Resolved, RunSpec  # noqa: E402
from homelab_dp.supervise.launcher import run_foreground  # noqa: E402

MODEL = ROOT / "assets" / "models" / "tiny-llama"
DATA = ROOT / "assets" / "data" / "tiny-text.jsonl"
SEQ_LEN, MICRO, ACCUM, LR = 128, 4, 2, 3e-4


def median_rate(ends: list[float], tokens: list[int]) -> float:
    """Median over steps of tokens / step time; ``ends`` has one more entry (the step before)."""
    return statistics.median(t / (b - a) for a, b, t in zip(ends, ends[1:], tokens, strict=False))


def plain(nproc: int, steps: int, warmup: int) -> float:
    """tokens/s of benchmarks/plain_ddp_loop.py under torchrun."""
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(ROOT / "benchmarks" / "plain_ddp_loop.py"),
           "--model", str(MODEL), "--data", str(DATA), "--seq-len", str(SEQ_LEN),
           "--micro", str(MICRO), "--accum", str(ACCUM), "--steps", str(steps),
           "--warmup", str(warmup), "--lr", str(LR)]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    line = json.loads(next(ln for ln in out.splitlines() if ln.startswith("{")))
    return median_rate(line["step_ends"], line["step_tokens"])


def worker(nproc: int, steps: int, warmup: int, root: Path, name: str) -> float:
    """tokens/s of the worker, from its own step events (rank 0's clock)."""
    preset = preset_from_dict(
        {
            "model": {"path": str(MODEL)},
            "data": {"path": str(DATA), "seq_len": SEQ_LEN, "pack": True},
            "train": {
                "method": "full",
                "distribution": "ddp",
                "micro_batch": MICRO,
                "grad_accum": ACCUM,
                "max_steps": steps,
                "lr": LR,
            },
            "hardware": {"devices": "cpu", "nproc": nproc},
        }
    )
    resolved = Resolved("full", "ddp", False, "cpu", nproc, "fp32", MICRO, ACCUM, LR)
    run_dir = create_run_dir(RunSpec(name, preset, resolved, Launch(nproc)), root)
    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    if run_foreground(run_dir, extra_env=env) != 0:
        raise SystemExit(f"worker run failed: see {run_dir / 'logs' / 'launcher.log'}")
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    by_step = {e["step"]: e for e in events if e["type"] == "step"}
    timed = [by_step[s] for s in range(warmup, steps + 1)]
    tokens = [b["tokens"] - a["tokens"] for a, b in zip(timed, timed[1:], strict=False)]
    return median_rate([e["time"] for e in timed], tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in args.nproc:
            p = w = 0.0
            for r in range(args.repeats):  # interleaved, so drift hits both alike
                p = max(p, plain(nproc, args.steps, args.warmup))
                w = max(w, worker(nproc, args.steps, args.warmup, Path(tmp), f"w{nproc}-{r}"))
            rows.append((nproc, p, w))
    print(f"tiny-llama, seq_len {SEQ_LEN}, micro {MICRO} x accum {ACCUM}, {args.steps} steps "
          f"({args.warmup} warm-up), CPU gloo, {os.cpu_count()} cores, median step, "
          f"best of {args.repeats}, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'processes':>9}  {'plain DDP tok/s':>15}  {'worker tok/s':>12}  {'ratio':>6}")
    for nproc, p, w in rows:
        print(f"{nproc:>9}  {p:>15.0f}  {w:>12.0f}  {w / p:>6.1%}")


if __name__ == "__main__":
    main()
