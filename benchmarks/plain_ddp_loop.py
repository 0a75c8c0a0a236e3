"""A minimal hand-written torchrun DDP loop: the baseline for benchmarks/throughput.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/plain_ddp_loop.py \\
        --model assets/models/tiny-llama --data assets/data/tiny-text.jsonl --steps 30

nanoGPT-style: DDP, AdamW (foreach), per-micro-batch mean loss, ``no_sync`` while accumulating,
gradient clipping at 1.0, no events, no checkpoints. Rank 0 prints one JSON line: the end time
and the tokens of every step after ``--warmup`` (``step_ends``, ``step_tokens``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForCausalLM, AutoTokenizer

from homelab_dp.data.eval_split import load_dataset
from homelab_dp.presets.preset import DataSection


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--pack", type=int, default=1)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    cfg = DataSection(path=args.data, seq_len=args.seq_len, pack=bool(args.pack))
    blocks = load_dataset(cfg, tokenizer, seq_len_limit=None, min_blocks=world * args.micro)
    ids = torch.tensor([b.input_ids for b in blocks])
    labels = torch.tensor([b.labels for b in blocks])
    mask = torch.tensor([b.attention_mask for b in blocks])
    positions = torch.tensor([b.position_ids for b in blocks])  # restart at each packed sample
    model = DDP(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=True)
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(42))

    ends, step_tokens = [], []
    per_step = args.micro * world * args.accum
    for step in range(args.steps):
        tokens = 0
        for k in range(args.accum):
            start = (step * per_step + (k * world + rank) * args.micro) % len(blocks)
            idx = order[torch.arange(start, start + args.micro) % len(blocks)]
            model.require_backward_grad_sync = k == args.accum - 1
            # Packed: no mask, the restarting positions keep attention within each sample.
            logits = model(input_ids=ids[idx], attention_mask=None if args.pack else mask[idx],
                           position_ids=positions[idx], use_cache=False).logits  # fmt: skip
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels[idx].flatten())
            (loss / args.accum).backward()
            tokens += int(mask[idx].sum()) * world  # every rank sees the same shapes here
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ends.append(time.time())
        step_tokens.append(tokens)
    if rank == 0:
        w = args.warmup
        print(json.dumps({"step_ends": ends[w - 1 :], "step_tokens": step_tokens[w:],
                          "world_size": world, "omp_threads": os.environ.get("OMP_NUM_THREADS")}))  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
