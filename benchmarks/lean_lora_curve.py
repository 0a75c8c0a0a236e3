"""The lean LoRA/QLoRA dtypes train as peft's fp32 preparation did: loss curves side by side (CPU).

    python benchmarks/lean_lora_curve.py [--steps 30] [--every 5] [--methods lora qlora]

The demo (presets/tiny-demo.toml: assets/models/tiny-llama on assets/data/tiny-instruct.jsonl,
packed 256-token blocks, micro-batch 4 × accumulation 2, AdamW, lr 3e-3 with 5 warm-up steps) in
one process, DDP on a one-process gloo group, under CPU bf16 autocast, with the worker's own
pieces: ``load_model`` (``compute=bfloat16``: the dtypes a bf16 CUDA run holds), ``wrap_model``,
``build_optimizer``, ``build_scheduler``, the sample order and slices, ``micro_step`` and
``optimizer_step``. Each method trains three times:

- ``fp32``: the old preparation, peft's ``prepare_model_for_kbit_training`` (every 16-bit
  parameter that is not 4-bit cast to fp32: embeddings, lm_head, norms, and for LoRA the base
  linears too), applied to the same loaded model, adapters trainable again;
- ``lean``: `train.lora` (the frozen base stays bf16), same seed, same adapters, same data order;
- ``noise``: lean with other adapter initial values (seed + 1): what a run-to-run change alone
  moves the curve by, the scale "within noise" is measured against.

Prints the loss every ``--every`` steps, the max |relative difference| lean vs fp32 and noise vs
lean over all steps, and each variant's parameter bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("fp32", "lean", "noise")


def _setup(method: str, steps: int) -> tuple[Any, Any, Any]:
    """The demo preset for ``method``, its Resolved (one CPU process), and its data."""
    from homelab_dp.presets.preset import load_preset
    from homelab_dp.runs.run_spec import Resolved
    from homelab_dp.train.loop.rank_setup import Rank, load_data

    preset = load_preset(ROOT / "presets" / "tiny-demo.toml")
    model = replace(preset.model, path=str(ROOT / preset.model.path))
    data = replace(preset.data, path=str(ROOT / preset.data.path))
    train = replace(preset.train, method=method, max_steps=steps)
    preset = replace(preset, model=model, data=data, train=train)
    t = preset.train
    resolved = Resolved(method=method, distribution="ddp", activation_checkpointing=False,  # type: ignore[arg-type]
                        device="cpu", world_size=1, dtype="fp32", micro_batch=t.micro_batch,
                        grad_accum=t.grad_accum, lr=t.lr)  # fmt: skip
    import torch

    rank = Rank(torch.device("cpu"), 0, 1, t.micro_batch, t.grad_accum, resolved.effective_batch)
    return preset, resolved, load_data(preset, rank)


def _old_preparation(model: Any) -> None:
    """peft's preparation on the loaded model; it freezes the adapters too, so free them again."""
    from peft import prepare_model_for_kbit_training

    prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    for name, p in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            p.requires_grad_(True)


def saved_bytes(model: Any, ids: Any, positions: Any, autocast: Any) -> int:
    """Bytes autograd saves for backward in one forward pass (each storage once)."""
    import torch

    seen: dict[tuple[int, Any], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[(s.data_ptr(), t.device)] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    del logits
    params = {(p.untyped_storage().data_ptr(), p.device) for p in model.parameters()}
    return sum(n for key, n in seen.items() if key not in params)  # weights are not activations


def train_curve(method: str, variant: str, steps: int) -> dict[str, Any]:
    """Train ``steps`` optimizer steps; the loss of each, parameter bytes and the first adapter."""
    import torch

    from homelab_dp.measure.memcheck import single_rank_group
    from homelab_dp.train.loop.training_loop import optimizer_step
    from homelab_dp.train.model.lora import param_bytes
    from homelab_dp.train.model.trainable_model import load_model
    from homelab_dp.train.objectives.sft import micro_step
    from homelab_dp.train.parallelism.strategy import (
        build_optimizer,
        build_scheduler,
        rank_slices,
        wrap_model,
    )

    preset, resolved, d = _setup(method, steps)
    cpu = torch.device("cpu")
    seed = preset.train.seed + (1 if variant == "noise" else 0)
    torch.manual_seed(seed)
    random.seed(seed)
    with tempfile.TemporaryDirectory() as tmp, single_rank_group(Path(tmp)):
        loaded = load_model(preset, resolved, cpu, compute=torch.bfloat16)
        if variant == "fp32":
            _old_preparation(loaded.model)
        first = next(p for n, p in loaded.model.named_parameters() if ".lora_A." in n)
        first = first.detach().clone()
        trainable = sum(p.numel() for p in loaded.model.parameters() if p.requires_grad)
        assert trainable == loaded.trainable_params, (trainable, loaded.trainable_params)
        strategy = wrap_model(loaded, resolved, cpu)
        optimizer = build_optimizer(strategy, preset.train, resolved.lr, cpu)
        scheduler = build_scheduler(optimizer, preset.train, steps)
        autocast = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
        r = resolved
        one = torch.tensor(d.order.blocks(0, r.micro_batch))
        saved = saved_bytes(strategy.inner, d.input_ids[one], d.positions[one], autocast)
        losses = []
        t0 = time.perf_counter()
        for step in range(steps):
            whole = torch.tensor(d.order.blocks(step * r.effective_batch, r.effective_batch))
            targets = float(d.targets[whole].sum())
            loss_sum = torch.zeros((), dtype=torch.float64)
            slices = rank_slices(step, r.micro_batch, 1, r.grad_accum, 0)
            for k, s in enumerate(slices):
                idx = torch.tensor(d.order.blocks(s.start, len(s)))
                with strategy.accumulate(final=k == r.grad_accum - 1):
                    mask = None if d.packed else d.mask[idx]
                    loss_sum += micro_step(
                        strategy, d.input_ids[idx], mask, d.labels[idx], 1.0 / max(targets, 1.0),
                        positions=d.positions[idx], autocast=autocast, loss_dtype=torch.float32,
                    )  # fmt: skip
            optimizer_step(strategy, optimizer, scheduler, None, preset.train.max_grad_norm)
            losses.append(float(loss_sum) / max(targets, 1.0))
        model = loaded.model
        return {
            "losses": losses,
            "seconds": time.perf_counter() - t0,
            "bytes": param_bytes(model),
            "frozen_bytes": param_bytes(model, trainable=False),
            "trainable_bytes": param_bytes(model, trainable=True),
            "first_adapter": first,
            "saved_per_token": saved / one.numel() / d.input_ids.shape[1],
        }


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--every", type=int, default=5, help="print the loss every N steps")
    parser.add_argument("--methods", nargs="*", default=["lora", "qlora"])
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    runs = {(m, v): train_curve(m, v, args.steps) for m in args.methods for v in VARIANTS}
    for m in args.methods:  # the same adapters at the start: only the base's dtypes differ
        fp32, lean = runs[m, "fp32"]["first_adapter"], runs[m, "lean"]["first_adapter"]
        assert bool((fp32 == lean).all()), f"{m}: the adapters' initial values differ"
    head = ["step"] + [f"{m} {v}" for m in args.methods for v in VARIANTS]
    print(" ".join(f"{h:>12}" for h in head))
    shown = sorted({s for s in range(args.every, args.steps + 1, args.every)} | {1, args.steps})
    for step in shown:
        row = [f"{step:>12}"]
        row += [f"{runs[m, v]['losses'][step - 1]:>12.5f}" for m in args.methods for v in VARIANTS]
        print(" ".join(row))
    print()
    for m in args.methods:
        fp32, lean, noise = (runs[m, v]["losses"] for v in VARIANTS)
        diff = max(_rel(a, b) for a, b in zip(lean, fp32, strict=True))
        spread = max(_rel(a, b) for a, b in zip(noise, lean, strict=True))
        print(f"{m}: max |lean - fp32| / fp32 over {args.steps} steps = {diff:.2e}; "
              f"noise (other adapter init) max |noise - lean| / lean = {spread:.2e}")  # fmt: skip
        for v in ("fp32", "lean"):
            r = runs[m, v]
            print(f"  {v:>5}: parameters {r['bytes']:,} B (frozen {r['frozen_bytes']:,} B, "
                  f"trainable {r['trainable_bytes']:,} B), saved for backward "
                  f"{r['saved_per_token']:,.0f} B/token, {r['seconds']:.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
