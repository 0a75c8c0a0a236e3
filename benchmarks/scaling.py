"""Predicted against measured tokens/s and speedup, at 1 and 2 processes (the CPU here).

    python benchmarks/scaling.py [--sizes tiny,s,m] [--strategies ddp,fsdp-full]
                                 [--accum 1,4] [--steps 8] [--seq-len 256] [--micro 4] [--json]

What a user does on a new machine, for several model sizes: on a fresh data home (a temporary
``XDG_DATA_HOME``, so no earlier calibration or gloo bandwidth is reused), one
``homelab-dp measure`` of the preset on one process (the time model's compute rate is calibrated
from it, and the first CPU plan measures the gloo bandwidth between two processes); then the
plan of every point (strategy × accumulation × 1 and 2 processes) is made *before* any of them
runs (a completed run recalibrates the store: planning them first keeps every figure a
prediction); then every point runs through the console script (``homelab-dp run PRESET --gpus
cpu:N --set …``) and is measured after its third step (`homelab_dp.runs.preset_results.
steady_speed`: the median of the step events after step 3). OpenMP waits passively
(``OMP_WAIT_POLICY=PASSIVE`` unless set): see tests/integration/test_scaling_prediction.py.

- **models**: ``tiny`` is assets/models/tiny-llama as shipped; ``s``, ``m``, ``l`` are random
  LLaMAs of the demo family (the demo tokenizer's 2048 tokens, GQA) written to a temporary
  folder with safetensors, as benchmarks/vs_hf_trainer.py does (``s`` is its model).
- **preset**: a full fine-tune in fp32 of packed blocks of the demo instruction data,
  ``--micro`` blocks of ``--seq-len`` per process, a step event every step, no checkpoint
  before the end.
- **points**: per accumulation, one process (no wrapper, whatever the strategy: the plan
  refuses FSDP on one device), then each strategy on 2 processes.
- **columns**: predicted and measured tokens/s (every process together), their ratio − 1;
  the speedup of 2 processes over the 1-process run of the same accumulation, predicted (the
  plan's ``speedup_vs_one_device``) and measured (2-process tokens/s ÷ 1-process tokens/s); the
  measured share of the step spent waiting on communication (step events' ``compute_seconds``,
  `homelab_dp.train.parallelism.comm_timing`; "-" when the worker did not log it).

On a GPU host ``--devices cuda`` runs the points on cards 0 and 0,1 (``--gpus``), still fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from homelab_dp.runs.preset_results import steady_speed  # noqa: E402 - after the path

EXE = Path(sys.executable).with_name("homelab-dp")
DEMO = ROOT / "assets" / "models" / "tiny-llama"
DATA = ROOT / "assets" / "data" / "tiny-instruct.jsonl"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
BASE = {"max_position_embeddings": 1024, "vocab_size": 2048, "bos_token_id": 0,
        "eos_token_id": 1, "pad_token_id": 2, "tie_word_embeddings": False}  # fmt: skip
SIZES: dict[str, dict[str, int] | None] = {
    "tiny": None,  # the shipped demo model
    "s": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32},
    "m": {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6,
          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 48},
    "l": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64},
}  # fmt: skip
"""Model sizes: None is the demo model; the others are LlamaConfig fields over `BASE`."""


def build_model(folder: Path, config: dict[str, int], seed: int = 0) -> None:
    """A random LLaMA of ``config`` with the demo tokenizer, saved with safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    cfg = LlamaConfig(**BASE, **config,
                      rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO / name, folder / name)


def preset_toml(model: Path, a: argparse.Namespace) -> str:
    """The benchmark's preset (see the module docstring); strategy, accumulation and process
    count come as --set and --gpus on each command."""
    return (
        f"# homelab-dp run scaling.toml --gpus cpu:N\n"
        f'[model]\npath = "{model}"\ndtype = "fp32"\n\n'
        f'[data]\npath = "{DATA}"\nseq_len = {a.seq_len}\npack = true\n\n'
        f'[train]\nmethod = "full"\ndistribution = "ddp"\nmicro_batch = {a.micro}\n'
        f"grad_accum = 1\nmax_steps = {a.steps}\nlog_every = 1\ncheckpoint_every = 0\n"
        f"lr = 1e-4\nactivation_checkpointing = false\n"
        + ('\n[hardware]\ndevices = "cpu"\nnproc = 1\n' if a.devices == "cpu" else "")
    )


def cli(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    """``homelab-dp ARGV`` in the benchmark's environment; exits with its output on failure."""
    out = subprocess.run([str(EXE), *argv], env=env, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"homelab-dp {' '.join(argv)} failed ({out.returncode}):\n"
                         f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")  # fmt: skip
    return out


def point_args(strategy: str, accum: int, procs: int, devices: str) -> list[str]:
    """The command-line arguments of one point."""
    gpus = f"cpu:{procs}" if devices == "cpu" else ",".join(str(i) for i in range(procs))
    return ["--gpus", gpus, "--set", f"train.distribution={strategy}",
            "--set", f"train.grad_accum={accum}"]  # fmt: skip


def planned(env: dict[str, str], preset: Path, args: list[str]) -> dict[str, Any]:
    """The plan's ``predicted`` block for one point."""
    doc = json.loads(cli(env, "plan", str(preset), *args, "--json").stdout)
    predicted = doc.get("predicted")
    if not isinstance(predicted, dict):
        raise SystemExit("plan --json has no 'predicted' block: the time model is missing")
    return predicted


def measured(env: dict[str, str], runs: Path, preset: Path, args: list[str]) -> dict[str, Any]:
    """Run one point; its steady speed from its events."""
    out = cli(env, "run", str(preset), *args, "--json")
    run_id = next((json.loads(x).get("run_id") for x in out.stdout.splitlines()
                   if x.startswith("{") and '"run_id"' in x), None)  # fmt: skip
    if run_id is None:
        raise SystemExit(f"no run id in the output of run:\n{out.stdout[-2000:]}")
    lines = (runs / run_id / "events.jsonl").read_text(encoding="utf-8").splitlines()
    speed = steady_speed([json.loads(x) for x in lines])
    if speed is None:
        raise SystemExit(f"run {run_id} logged no step")
    return speed


def model_params(folder: Path) -> int:
    """Parameters of a saved model, from its safetensors header (no torch)."""
    total = 0
    for path in folder.glob("*.safetensors"):
        with path.open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        for name, meta in header.items():
            if name != "__metadata__":
                n = 1
                for d in meta["shape"]:
                    n *= d
                total += n
    return total


def bench_size(size: str, tmp: Path, a: argparse.Namespace) -> list[dict[str, Any]]:
    """Every point of one model size, planned first, then run (see the module docstring)."""
    home = tmp / size
    runs = home / "runs"
    runs.mkdir(parents=True)
    env = {**os.environ, "XDG_DATA_HOME": str(home / "data"), "XDG_CACHE_HOME": str(home / "c"),
           "HOMELAB_DP_RUNS": str(runs)}  # fmt: skip
    env.pop("HOMELAB_DP_FAULT", None)
    # OpenMP threads that spin at each barrier collapse on a shared machine (one process's two
    # threads ran 10-25× slower here while other work held a core): wait passively.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    config = SIZES[size]
    model = DEMO
    if config is not None:
        model = home / "model"
        build_model(model, config)
    preset = home / "scaling.toml"
    preset.write_text(preset_toml(model, a), encoding="utf-8")
    cli(env, "measure", str(preset), *point_args("ddp", 1, 1, a.devices)[:2], "--steps",
        str(a.measure_steps))  # fmt: skip
    # One process runs no wrapper whatever the strategy (the plan refuses FSDP on one device):
    # each accumulation's 1-process run is the reference of every strategy's 2-process run.
    points = [("ddp", acc, 1) for acc in a.accum]
    points += [(s, acc, 2) for s in a.strategies for acc in a.accum]
    plans = {p: planned(env, preset, point_args(*p, a.devices)) for p in points}
    rows = []
    for p in points:
        m = measured(env, runs, preset, point_args(*p, a.devices))
        rows.append({"model": size, "params": model_params(model), "strategy": p[0],
                     "grad_accum": p[1], "processes": p[2], "predicted": plans[p],
                     "measured": m})  # fmt: skip
        print(f"  {size} {p[0]} accum {p[1]} × {p[2]}: predicted "
              f"{plans[p].get('tokens_per_s') or 0:.0f}, measured {m['tokens_per_s']:.0f} tok/s",
              file=sys.stderr, flush=True)  # fmt: skip
    for row in rows:  # measured speedup: against the 1-process run of the same point
        one = next(r for r in rows if r["grad_accum"] == row["grad_accum"]
                   and r["processes"] == 1)  # fmt: skip
        row["measured_speedup"] = row["measured"]["tokens_per_s"] / one["measured"]["tokens_per_s"]
        pred = row["predicted"].get("tokens_per_s")
        row["error"] = row["measured"]["tokens_per_s"] / pred - 1.0 if pred else None
    return rows


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of the module docstring's columns."""
    head = ("| model | params | strategy | accum | procs | predicted tok/s | measured tok/s "
            "| error | speedup pred. | speedup meas. | comm share meas. |")  # fmt: skip
    out = [head, "|" + "---|" * 11]
    for r in rows:
        p, m = r["predicted"], r["measured"]
        out.append(
            f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['strategy']} | {r['grad_accum']} "
            f"| {r['processes']} | {_f(p.get('tokens_per_s'), '.0f')} "
            f"| {m['tokens_per_s']:.0f} | {_f(r['error'], '+.0%')} "
            f"| {_f(p.get('speedup_vs_one_device'), '.2f')}× | {r['measured_speedup']:.2f}× "
            f"| {_f(m.get('comm_share') if r['processes'] > 1 else None, '.0%')} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run every size, print the table (or --json)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,s,m", help=f"of {','.join(SIZES)}")
    ap.add_argument("--strategies", default="ddp,fsdp-full")
    ap.add_argument("--accum", default="1,4")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    ap.add_argument("--measure-steps", type=int, default=6, help="steps of the measure run")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro", type=int, default=4, help="packed blocks per process")
    ap.add_argument("--devices", default="cpu", help="cpu, or cuda on a GPU host")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    a.strategies = a.strategies.split(",")
    a.accum = [int(x) for x in a.accum.split(",")]
    sizes = a.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"--sizes: unknown {unknown}; use {','.join(SIZES)}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="homelab-dp-scaling-") as tmp:
        for size in sizes:
            rows += bench_size(size, Path(tmp), a)
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
