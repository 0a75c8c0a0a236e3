"""What one optimizer step of the worker costs besides its arithmetic: host reads, Python, ops.

    python benchmarks/step_profile.py [--steps 6] [--tree PATH] [--set KEY=VALUE] [--top N] [--json]

Load-independent counts for the per-step overhead work of issue 33 (a shared machine's wall
time moves by tens of percent; these counts do not move at all). The worker runs in this
process's child as rank 0 of a world of 1 (gloo), on `vs_hf_trainer.py`'s model and ragged
data (packed, seq_len 512, micro-batch 4, full fine-tune, fp32), twice: ``--steps`` and twice
as many optimizer steps. Each count's difference over the extra steps is its cost per step, so
set-up, the start event and the end are left out exactly:

- **host reads**: calls that read a tensor's value into Python (``item``, ``tolist``,
  ``__bool__``, ``__float__``, ``__int__``, ``__index__``; a ``torch.overrides``
  TorchFunctionMode sees every one), by the source line that made them. On a GPU each read of a
  device tensor is a host sync; on the CPU they show where a GPU run would sync.
- **torch calls**: every call through torch's Python API (the same mode): the Python-side
  dispatch work a step does.
- **Python calls**: function calls the profiler (``cProfile``) counts, C functions included.
- **CPU ms**: ``time.process_time`` per step (one thread; load inflates it less than wall time);
  ``short_run_cpu_s``: the whole short run's, set-up and any compile included.

``--tree PATH`` profiles the homelab_dp of another source tree (e.g. a ``git archive`` of an
older commit), for before/after figures.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


def child(run_dir: Path, out: Path) -> None:
    """Rank 0 of a world of 1: the worker's main under the counters; writes ``out``."""
    import torch
    from torch.overrides import TorchFunctionMode

    from homelab_dp.train.loop import worker

    reads: collections.Counter[str] = collections.Counter()
    calls = [0]

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            calls[0] += 1
            name = getattr(func, "__name__", "")
            if name in READS:
                frame = sys._getframe(1)
                while frame is not None and "homelab_dp" not in frame.f_code.co_filename:
                    frame = frame.f_back
                where = "outside homelab_dp"
                if frame is not None:
                    path = frame.f_code.co_filename.split("homelab_dp/")[-1]
                    where = f"{path}:{frame.f_lineno} {frame.f_code.co_name}"
                reads[f"{name} {where}"] += 1
            return func(*args, **(kwargs or {}))

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))  # fmt: skip
    torch.set_num_threads(1)
    profile = cProfile.Profile()
    cpu0 = time.process_time()
    with Count():
        profile.enable()
        rc = worker.main([str(run_dir)])
        profile.disable()
    cpu = time.process_time() - cpu0
    stats = pstats.Stats(profile)
    table = stats.stats  # type: ignore[attr-defined]
    n_calls = sum(v[1] for v in table.values())
    functions = {f"{Path(k[0]).name}:{k[1]} {k[2]}": [v[1], v[2]] for k, v in table.items()}
    out.write_text(json.dumps({"rc": rc, "reads": dict(reads), "torch_calls": calls[0],
                               "python_calls": n_calls, "cpu_s": cpu,
                               "functions": functions}))  # fmt: skip


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prepare(tmp: Path, steps: int, a: argparse.Namespace) -> Path:
    """A run folder of `vs_hf_trainer`'s preset with ``steps`` steps on 1 CPU process."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import vs_hf_trainer as bench

    from homelab_dp.app.runs import make_controller
    from homelab_dp.runs.folder.run_folder import create_run_dir, new_run_id

    model, data = tmp / "model", tmp / "ragged.jsonl"
    if not model.exists():
        vocab = json.loads((bench.DEMO / "tokenizer.json").read_text())["model"]["vocab"]
        words, pieces = bench.vocabulary_words(vocab)
        bench.write_jsonl(bench.ragged_records(a.samples, words, pieces, lo=3, hi=300, seed=0),
                          data)  # fmt: skip
        bench.build_model(model, 0)
    ns = argparse.Namespace(seq_len=512, micro=4, accum=1, steps=steps, lr=3e-4, seed=0, nproc=1)
    preset = tmp / f"profile-{steps}.toml"
    preset.write_text(bench.preset_toml(model, data, ns), encoding="utf-8")
    controller = make_controller(tmp / "runs")
    prepared = controller.prepare(str(preset), overrides=list(a.set), gpus="cpu:1")
    return create_run_dir(prepared.run_spec(new_run_id("profile")), tmp / "runs")


def measure(run_dir: Path, tree: Path) -> dict[str, Any]:
    """Run `child` in a fresh interpreter with ``tree`` first on the path."""
    out = run_dir / "profile.json"
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    env.pop("HOMELAB_DP_FAULT", None)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(run_dir), str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"profile run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(out.read_text())
    if result["rc"] != 0:
        raise SystemExit(f"worker exit {result['rc']}: see {run_dir}/logs")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps of the short run (long: 2x)")
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--tree", type=Path, default=ROOT, help="source tree holding homelab_dp")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        help="a preset override (KEY=VALUE), e.g. train.compile=true",
    )
    parser.add_argument(
        "--top",
        type=int,
        default=0,
        help="also list the N functions with the most own time per step",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child:
        return child(*a.child)
    with tempfile.TemporaryDirectory(prefix="step-profile-") as name:
        tmp = Path(name)
        os.environ["HOMELAB_DP_RUNS"] = str(tmp / "runs")
        os.environ["XDG_DATA_HOME"] = str(tmp)
        short = measure(prepare(tmp, a.steps, a), a.tree.resolve())
        long = measure(prepare(tmp, 2 * a.steps, a), a.tree.resolve())
    n = a.steps
    reads = {k: (long["reads"].get(k, 0) - short["reads"].get(k, 0)) / n
             for k in set(long["reads"]) | set(short["reads"])}  # fmt: skip
    per_step = {
        "host_reads": sum(reads.values()),
        "torch_calls": (long["torch_calls"] - short["torch_calls"]) / n,
        "python_calls": (long["python_calls"] - short["python_calls"]) / n,
        "cpu_ms": (long["cpu_s"] - short["cpu_s"]) / n * 1000,
        "short_run_cpu_s": short["cpu_s"],
        "reads_by_site": {k: v for k, v in sorted(reads.items(), key=lambda kv: -kv[1]) if v},
    }
    own = {}
    for k, (calls, tottime) in long["functions"].items():
        c0, t0 = short["functions"].get(k, (0, 0.0))
        own[k] = ((calls - c0) / n, (tottime - t0) / n * 1000)
    per_step["top_own_ms"] = {
        k: v for k, v in sorted(own.items(), key=lambda kv: -kv[1][1])[: a.top]
    }
    if a.json:
        print(json.dumps(per_step))
        return
    print(f"per optimizer step (tree {a.tree}, {n} extra steps, 1 process, 1 thread):")
    for key in ("host_reads", "torch_calls", "python_calls", "cpu_ms", "short_run_cpu_s"):
        print(f"  {key:<13} {per_step[key]:>10.1f}")
    for site, count in per_step["reads_by_site"].items():
        print(f"    {count:>7.2f}  {site}")
    if a.top:
        print("  own time per step (cProfile; ms, calls):")
        for k, (calls, ms) in per_step["top_own_ms"].items():
            print(f"    {ms:>8.2f} {calls:>8.1f}  {k}")


if __name__ == "__main__":
    main()
