"""Tokens/s against sequence length on the CPU, tiled MLP off and on, beside the time model.

    python benchmarks/long_context.py [--seq-lens 512 1024 2048 4096] [--steps 3]
                                      [--method lora] [--json OUT.json] [--sequence-parallel 2]

One CPU process (the worker's own pieces, in this process: `train.model.trainable_model.load_model`,
the chunked loss head, AdamW over the trainable parameters), the tiny demo model
(assets/models/tiny-llama), micro-batch 1, activation checkpointing off. For each length, the
median time of ``--steps`` optimizer steps (after one warm-up step) with the MLP untiled and
tiled (`train.tiled_mlp`, `homelab_dp.train.model.tiled_mlp`), as tokens/s, beside what `homelab-dp
plan` predicts for the same run on one CPU process (`plan --json`'s ``predicted.tokens_per_s``:
the time model, at this machine's measured rate when `homelab-dp measure` recorded one, else the
stated default) and the live-tensor peak of the step's backward (`train.loop.memtrack.LiveTensors`,
one tracked step) beside the plan's.

With ``--sequence-parallel 2`` each length is also run for real through the console script
(``homelab-dp run PRESET --gpus cpu:1`` and ``--gpus cpu:2 --set train.sequence_parallel=2``,
the same preset: the tiny model with ``max_position_embeddings`` raised to the longest length
(the CLI refuses a ``data.seq_len`` beyond it; the weights are the same), LoRA, micro-batch 1, tiled MLP and checkpointing off, packed blocks of
assets/data/tiny-text.jsonl, ``--steps`` + 1 optimizer steps) in a temporary runs folder with a
temporary ``XDG_DATA_HOME`` (so the plan prices compute at the stated defaults, not at what
earlier runs on this machine recorded). Measured tokens/s: the step events' tokens from the
first step's event to the last ÷ the time between them (the first step left out: warm-up);
beside ``homelab-dp plan PRESET --gpus cpu:N --json``'s ``predicted.tokens_per_s`` in the same
environment. The ``sp2`` column of the first table is the 2-process split run's figure (the
untiled rows); a second table sets it beside the 1-process CLI run of the same length (the
in-process column runs one thread, without the launcher, so it is not the fair comparison).
Without the flag the ``sp2`` column stays empty.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from homelab_dp.app.plan import make_plan
from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.runs.run_spec import Resolved
from homelab_dp.train.loop.memtrack import LiveTensors
from homelab_dp.train.model.loss import install_loss_head
from homelab_dp.train.model.tiled_mlp import tile_mlps
from homelab_dp.train.model.trainable_model import load_model

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "assets" / "models" / "tiny-llama"
TEXT = ROOT / "assets" / "data" / "tiny-text.jsonl"
EXE = [sys.executable, "-m", "homelab_dp.cli"]


def preset(method: str, seq_len: int, tiled: bool) -> Any:
    """The benchmarked run as a preset (what `plan` is asked about)."""
    return preset_from_dict({
        "model": {"path": str(TINY)},
        "data": {"path": str(ROOT / "assets" / "data" / "tiny-instruct.jsonl"), "seq_len": seq_len},
        "train": {"method": method, "distribution": "ddp", "micro_batch": 1, "grad_accum": 1,
                  "activation_checkpointing": False, "tiled_mlp": "on" if tiled else "off"},
        "lora": {"r": 8, "dropout": 0.0},
    })  # fmt: skip


def predicted(method: str, seq_len: int, tiled: bool) -> dict[str, Any]:
    """The plan's tokens/s and backward peak for the run on one CPU process."""
    p = make_plan(preset(method, seq_len, tiled), "cpu:1").plan
    pred = p.chosen.predicted
    return {
        "tokens_per_s": pred.tokens_per_s if pred else None,
        "backward_bytes": p.chosen.budget.phases.get("backward"),
        "tiled": p.chosen.tiled_mlp,
    }


def measure(method: str, seq_len: int, tiled: bool, steps: int) -> dict[str, Any]:
    """Median tokens/s of ``steps`` steps (one warm-up first) and one tracked step's peak."""
    resolved = Resolved(method=method, distribution="ddp", activation_checkpointing=False,  # type: ignore[arg-type]
                        device="cpu", world_size=1, dtype="fp32", micro_batch=1, grad_accum=1,
                        lr=1e-4)  # fmt: skip
    torch.manual_seed(0)
    loaded = load_model(preset(method, seq_len, tiled), resolved, torch.device("cpu"))
    model = loaded.model.train()
    head = install_loss_head(model)
    if tiled:
        tile_mlps(loaded.decoder_layers, int(model.config.hidden_size))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(3, int(model.config.vocab_size), (1, seq_len),
                        generator=torch.Generator().manual_seed(1))  # fmt: skip
    pos = torch.arange(seq_len)[None]

    def step(live: LiveTensors | None = None) -> float:
        t0 = time.perf_counter()
        with live if live is not None else contextlib.nullcontext():
            with head.targets(ids):  # type: ignore[attr-defined]
                loss = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            if live is not None:
                live.reset_peak()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step()  # warm-up (and the optimizer state)
    times = [step() for _ in range(steps)]
    live = LiveTensors()
    live.track(model.parameters(), "weights")
    live.track((s for st in opt.state.values() for s in st.values()), "optimizer")
    step(live)
    return {"tokens_per_s": seq_len / statistics.median(times), "backward_bytes": live.peak}


def long_copy(tmp: Path, positions: int) -> Path:
    """The tiny model with ``max_position_embeddings`` raised to ``positions`` (the same weights;
    RoPE has no table, so only the CLI's check of ``data.seq_len`` against it changes)."""
    out = tmp / "tiny-llama-long"
    shutil.copytree(TINY, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = max(positions, int(config["max_position_embeddings"]))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def cli_preset(model: Path, method: str, seq_len: int, steps: int) -> str:
    """The CLI runs' preset (TOML): packed blocks of ``seq_len`` tokens, no evaluation."""
    return (
        f'[model]\npath = "{model}"\ndtype = "fp32"\n\n'
        f'[data]\npath = "{TEXT}"\nseq_len = {seq_len}\npack = true\neval_fraction = 0.0\n\n'
        f'[train]\nmethod = "{method}"\ndistribution = "ddp"\nmicro_batch = 1\ngrad_accum = 1\n'
        f'max_steps = {steps + 1}\nactivation_checkpointing = false\ntiled_mlp = "off"\n'
        f"lr = 1e-4\nseed = 0\n\n[lora]\nr = 8\ndropout = 0.0\n"
    )


def cli_tokens_per_s(events: list[dict[str, Any]], skip: int = 1) -> float:
    """Tokens/s over the step events after the first ``skip``: tokens from the first kept
    event to the last ÷ the time between them."""
    steps = [e for e in events if e.get("type") == "step"]
    if len(steps) < skip + 2:
        raise ValueError(f"{len(steps)} step events: too few to time (need {skip + 2})")
    first, last = steps[skip], steps[-1]
    return (last["tokens"] - first["tokens"]) / (last["time"] - first["time"])


def _cli(args: list[str], env: dict[str, str], timeout: float) -> str:
    done = subprocess.run([*EXE, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False, cwd=ROOT)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout


def cli_run(method: str, seq_len: int, steps: int, processes: int, split: int,
            tmp: Path) -> dict[str, Any]:  # fmt: skip
    """One real run through the CLI on ``processes`` CPU processes (every sequence split over
    ``split`` of them when above 1) and the plan's prediction for it."""
    env = {**os.environ, "XDG_DATA_HOME": str(tmp / "data"), "PYTHONPATH": str(ROOT)}
    path = tmp / f"lc-{seq_len}.toml"
    model = tmp / "tiny-llama-long"
    path.write_text(cli_preset(model, method, seq_len, steps))
    common = ["--gpus", f"cpu:{processes}"]
    if split > 1:
        common += ["--set", f"train.sequence_parallel={split}"]
    plan_doc = json.loads(_cli(["plan", str(path), *common, "--json"], env, 600))
    out = _cli(["run", str(path), *common, "--json", "--runs",
                str(tmp / f"runs-{seq_len}-{processes}")], env, 3600)  # fmt: skip
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {
        "tokens_per_s": cli_tokens_per_s(events),
        "predicted_tokens_per_s": (plan_doc.get("predicted") or {}).get("tokens_per_s"),
    }


def _fmt(x: float | None) -> str:
    return f"{x:,.0f}" if x else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--method", default="lora", choices=("full", "lora"))
    ap.add_argument("--json", type=Path, help="write the rows here too")
    ap.add_argument("--sequence-parallel", type=int, default=0, choices=(0, 2),
                    help="2: also run each length through the CLI on 1 process and on 2 "
                         "processes splitting every sequence")  # fmt: skip
    args = ap.parse_args()
    cli: dict[int, dict[str, Any]] = {}
    if args.sequence_parallel:
        with tempfile.TemporaryDirectory(prefix="long-context-") as d:
            long_copy(Path(d), max(args.seq_lens))
            for n in args.seq_lens:
                cli[n] = {"one": cli_run(args.method, n, args.steps, 1, 1, Path(d)),
                          "split": cli_run(args.method, n, args.steps, 2, 2, Path(d))}  # fmt: skip
    torch.set_num_threads(1)
    rows = []
    print("| seq_len | tiled | measured tok/s | predicted tok/s | ratio − 1 | backward peak "
          "MiB (measured / plan) | sp2 tok/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for n in args.seq_lens:
        for tiled in (False, True):
            got, want = measure(args.method, n, tiled, args.steps), predicted(args.method, n, tiled)
            rows.append({"seq_len": n, "tiled_mlp": tiled, "measured": got, "predicted": want})
            sp = cli[n]["split"] if n in cli and not tiled else None
            sp2 = (
                f"{_fmt(sp['tokens_per_s'])} ({_fmt(sp['predicted_tokens_per_s'])})" if sp else "-"
            )
            pt = want["tokens_per_s"]
            ratio = f"{got['tokens_per_s'] / pt - 1:+.0%}" if pt else "-"
            print(f"| {n} | {'on' if tiled else 'off'} | {got['tokens_per_s']:,.0f} | "
                  f"{pt:,.0f} | {ratio} | {got['backward_bytes'] / 2**20:,.1f} / "
                  f"{(want['backward_bytes'] or 0) / 2**20:,.1f} | {sp2} |" if pt else
                  f"| {n} | {tiled} | {got['tokens_per_s']:,.0f} | - | - | - | - |")  # fmt: skip
    if cli:
        print()
        print("| seq_len | 1 process tok/s (plan) | 2 processes, sequence split ×2, tok/s (plan) "
              "| 2 ÷ 1 measured (plan) |")  # fmt: skip
        print("|---|---|---|---|")
        for n, c in cli.items():
            one, two = c["one"], c["split"]
            po, pt2 = one["predicted_tokens_per_s"], two["predicted_tokens_per_s"]
            plan_ratio = f"{pt2 / po:.2f}" if po and pt2 else "-"
            print(
                f"| {n} | {_fmt(one['tokens_per_s'])} ({_fmt(po)}) | "
                f"{_fmt(two['tokens_per_s'])} ({_fmt(pt2)}) | "
                f"{two['tokens_per_s'] / one['tokens_per_s']:.2f} ({plan_ratio}) |"
            )
    if args.json:
        args.json.write_text(json.dumps({"in_process": rows, "cli": cli}, indent=1))


if __name__ == "__main__":
    main()
