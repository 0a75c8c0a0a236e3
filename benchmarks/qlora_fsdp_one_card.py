"""QLoRA under FSDP2 on one card, with each offload mode, beside QLoRA loaded whole.

    python benchmarks/qlora_fsdp_one_card.py MODEL_DIR [--device cuda|cpu] [--steps 6]
                                             [--seq-len 512] [--micro 4] [--json]

FSDP2 across cards needs two of them (NCCL takes one rank per card), and `homelab-dp` plans
sharding only on two or more devices; this checks the CUDA half of QLoRA-FSDP on a machine with
one card, in one process (a process group of one): the worker's own set-up
(`homelab_dp.train.loop.rank_setup.build_model`: the streamed 4-bit load, ``fully_shard`` with the
compute-dtype quant storage and mixed precision, ``CPUOffloadPolicy`` in pinned memory, the
host-stepping AdamW, the activation offload hooks) and its own micro and optimizer steps, on the same seeded
batches. For each configuration it reports the loss of every step (the largest difference from
the whole-model QLoRA run beside it), the peak of ``torch.cuda.max_memory_allocated`` (live
tensor bytes are not tracked on the CPU: ``--device cpu`` only tests the script), the memory
model's estimate of the same shape (`homelab_dp.planning.memory.device_memory.budget`, world size 1) and tokens/s
(the steps after the first). `benchmarks/gpu_validate.py` runs it as its QLoRA-FSDP row.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "assets" / "data" / "tiny-text.jsonl"
CONFIGS = (
    ("whole (DDP path)", "ddp", "none", False),
    ("fsdp-full", "fsdp-full", "none", False),
    ("fsdp-full, offload params", "fsdp-full", "params", False),
    ("fsdp-full, offload optimizer", "fsdp-full", "optimizer", False),
    ("fsdp-full, offload activations", "fsdp-full", "none", True),
)
"""(name, distribution, train.offload, train.offload_activations)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spec(model: Path, device: str, dist: str, offload: str, acts: bool, a: Any) -> Any:
    from homelab_dp.presets.preset import preset_from_dict
    from homelab_dp.runs.run_spec import Launch, Resolved, RunSpec

    train = {"method": "qlora", "distribution": dist, "micro_batch": a.micro, "grad_accum": 1,
             "max_steps": a.steps, "lr": 1e-4, "seed": 7, "activation_checkpointing": True,
             "offload": offload, "offload_activations": acts, "compile": False}  # fmt: skip
    preset = preset_from_dict({"model": {"path": str(model)},
                               "data": {"path": str(DATA), "seq_len": a.seq_len},
                               "train": train, "hardware": {"devices": "cpu", "nproc": 1}})  # fmt: skip
    dtype = "bf16" if device == "cuda" else "fp32"
    resolved = Resolved(method="qlora", distribution=dist, activation_checkpointing=True,
                        device=device, world_size=1, dtype=dtype, micro_batch=a.micro,
                        grad_accum=1, lr=1e-4, offload=offload,
                        offload_activations=acts)  # type: ignore[arg-type]  # fmt: skip
    return RunSpec(
        run_id="one-card", preset=preset, resolved=resolved, launch=Launch(nproc_per_node=1)
    )


def _estimate(model: Path, spec: Any) -> int:
    """The memory model's tensor peak for this shape on one device."""
    from homelab_dp.planning.memory.device_memory import TrainShape, budget
    from homelab_dp.planning.model_spec import load_model_spec

    r = spec.resolved
    shape = TrainShape(method="qlora", distribution=r.distribution, world_size=1, device=r.device,
                       dtype=r.dtype, micro_batch=r.micro_batch, seq_len=spec.preset.data.seq_len,
                       activation_checkpointing=True, offload=r.offload,
                       offload_activations=r.offload_activations)  # fmt: skip
    return budget(load_model_spec(model), shape).tensors


def _one(model: Path, device: Any, name: str, spec: Any, batches: list[Any]) -> dict[str, Any]:
    import torch

    from homelab_dp.train.loop.rank_setup import Rank, build_model
    from homelab_dp.train.loop.training_loop import optimizer_step
    from homelab_dp.train.objectives.sft import micro_step

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    micro = spec.resolved.micro_batch
    m = build_model(spec, Rank(device, 0, 1, micro, 1, micro), len(batches))
    losses, seconds = [], []
    for ids in batches:
        t = time.perf_counter()
        labels = ids.clone()
        loss = micro_step(m.strategy, ids.to(device), None, labels, 1.0 / labels[:, 1:].numel(),
                          autocast=m.autocast, loss_dtype=m.loss_dtype,
                          positions=torch.arange(ids.shape[1]).expand_as(ids).to(device),
                          loss_head=m.loss_head)  # fmt: skip
        optimizer_step(m.strategy, m.optimizer, m.scheduler, m.scaler, 1.0)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t)
        losses.append(float(loss) / labels[:, 1:].numel())
    peak = torch.cuda.max_memory_allocated() if cuda else None
    del m
    gc.collect()
    tokens = batches[0].numel()
    rate = tokens / statistics.median(seconds[1:]) if len(seconds) > 1 else None
    return {"config": name, "losses": losses, "peak_bytes": peak,
            "estimate_bytes": _estimate(model, spec), "tokens_per_s": rate}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a model folder (safetensors, tokenizer)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    a = parser.parse_args(argv)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1")  # fmt: skip
    import torch
    import torch.distributed as dist

    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 0
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(a.model).vocab_size
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (a.micro, a.seq_len), generator=gen) for _ in range(a.steps)]
    rows = []
    for name, distribution, offload, acts in CONFIGS:
        spec = _spec(a.model, a.device, distribution, offload, acts, a)
        try:
            rows.append(_one(a.model, device, name, spec, batches))
        except Exception as exc:  # one configuration failing must not hide the others
            rows.append({"config": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
    dist.destroy_process_group()
    whole = rows[0].get("losses")
    for row in rows:
        if whole and row.get("losses"):
            row["max_loss_diff"] = max(
                abs(x - y) for x, y in zip(row["losses"], whole, strict=True)
            )
    if a.json:
        print(json.dumps({"device": a.device, "rows": rows}))
    else:
        for row in rows:
            print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
