"""Tokens/s against sequence length on the CPU, tiled MLP off and on, beside the time model.

    python benchmarks/long_context.py [--seq-lens 512 1024 2048 4096] [--steps 3]
                                      [--method lora] [--json OUT.json]

One CPU process (the worker's own pieces, in this process: `train.trainable_model.load_model`,
the chunked loss head, AdamW over the trainable parameters), the tiny demo model
(assets/models/tiny-llama), micro-batch 1, activation checkpointing off. For each length, the
median time of ``--steps`` optimizer steps (after one warm-up step) with the MLP untiled and
tiled (`train.tiled_mlp`, `homelab_dp.train.tiled_mlp`), as tokens/s, beside what `homelab-dp
plan` predicts for the same run on one CPU process (`plan --json`'s ``predicted.tokens_per_s``:
the time model, at this machine's measured rate when `homelab-dp measure` recorded one, else the
stated default) and the live-tensor peak of the step's backward (`train.memtrack.LiveTensors`,
one tracked step) beside the plan's.

The ``sp2`` columns are for two processes with ``train.sequence_parallel = 2`` (each holding
half of every sequence): left empty here until the sequence-parallel worker exists; the
``--sequence-parallel`` flag is reserved for it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from homelab_dp.app.plan import make_plan
from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.runs.run_spec import Resolved
from homelab_dp.train.loss import install_loss_head
from homelab_dp.train.memtrack import LiveTensors
from homelab_dp.train.tiled_mlp import tile_mlps
from homelab_dp.train.trainable_model import load_model

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "assets" / "models" / "tiny-llama"


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--method", default="lora", choices=("full", "lora"))
    ap.add_argument("--json", type=Path, help="write the rows here too")
    ap.add_argument("--sequence-parallel", type=int, default=0,
                    help="reserved: 2 processes splitting each sequence (not yet here)")  # fmt: skip
    args = ap.parse_args()
    if args.sequence_parallel:
        raise SystemExit("--sequence-parallel: the sequence-parallel worker is not in this build")
    torch.set_num_threads(1)
    rows = []
    print("| seq_len | tiled | measured tok/s | predicted tok/s | ratio − 1 | backward peak "
          "MiB (measured / plan) | sp2 tok/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for n in args.seq_lens:
        for tiled in (False, True):
            got, want = measure(args.method, n, tiled, args.steps), predicted(args.method, n, tiled)
            rows.append({"seq_len": n, "tiled_mlp": tiled, "measured": got, "predicted": want})
            pt = want["tokens_per_s"]
            ratio = f"{got['tokens_per_s'] / pt - 1:+.0%}" if pt else "-"
            print(f"| {n} | {'on' if tiled else 'off'} | {got['tokens_per_s']:,.0f} | "
                  f"{pt:,.0f} | {ratio} | {got['backward_bytes'] / 2**20:,.1f} / "
                  f"{(want['backward_bytes'] or 0) / 2**20:,.1f} | - |" if pt else
                  f"| {n} | {tiled} | {got['tokens_per_s']:,.0f} | - | - | - | - |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
