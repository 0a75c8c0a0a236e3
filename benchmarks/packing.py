"""Best-fit-decreasing packing: time and fill for seeded ragged sample lengths; and packed
attention: SDPA with a block-diagonal mask against homelab_packed (each sample alone).

    python benchmarks/packing.py [--items 1000 10000 100000] [--capacity 2048]
    python benchmarks/packing.py --attention [--batch 4] [--seq-len 512] [--repeats 7]

Prints, per item count: the seconds `best_fit_decreasing` takes, the blocks it opens, the lower
bound (total length / capacity, rounded up) and the fill (total length / block capacity). The
unit test bounds the 100k case only as a liveness guard; this is where the figure lives.

``--attention``: one attention layer's forward and backward (8 query and 4 key/value heads of
32, fp32, on this machine's device, one thread) over packed rows of seeded long-tailed sample
lengths (log-uniform 20 to 450 tokens): the masked route transformers' SDPA takes for packed
blocks (a (b, 1, s, s) mask, key/value heads repeated) and `train.model.packed_attention`'s; the
median milliseconds and the bytes saved for backward of each.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from homelab_dp.data.blocks import best_fit_decreasing  # noqa: E402


def sample_rows(batch: int, seq_len: int, rng: random.Random) -> list[list[int]]:
    """Rows of ``seq_len`` tokens cut into samples of log-uniform 20..450 tokens."""
    rows = []
    for _ in range(batch):
        row, left = [], seq_len
        while left > 0:
            n = min(left, round(math.exp(rng.uniform(math.log(20), math.log(450)))))
            row.append(n)
            left -= n
        rows.append(row)
    return rows


def attention(batch: int, seq_len: int, repeats: int) -> None:
    """The ``--attention`` table (see the module docstring)."""
    import statistics

    import torch
    import torch.nn.functional as F

    from homelab_dp.train.model.packed_attention import PackedSegments, packed_attention_forward

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = sample_rows(batch, seq_len, random.Random(0))
    heads, kv, dim = 8, 4, 32
    q = torch.randn(batch, heads, seq_len, dim, requires_grad=True)
    k, v = (torch.randn(batch, kv, seq_len, dim, requires_grad=True) for _ in range(2))
    ids = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in rows])
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    mask = (ids[:, None, :, None] == ids[:, None, None, :]) & causal
    segments = PackedSegments(tuple(tuple(r) for r in rows), q.device)
    module = torch.nn.Module()

    def masked() -> torch.Tensor:
        kk, vv = (t.repeat_interleave(heads // kv, 1) for t in (k, v))
        return (
            F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask).transpose(1, 2).contiguous()
        )

    def lean() -> torch.Tensor:
        return packed_attention_forward(module, q, k, v, segments)[0]

    print(f"rows {rows}")
    print(f"{'route':<16} {'ms fwd+bwd':>10} {'saved MiB':>9}")
    for name, fn in (("sdpa, masked", masked), ("homelab_packed", lean)):
        seen: dict[int, int] = {}

        def keep(t: torch.Tensor, seen: dict[int, int] = seen) -> torch.Tensor:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn().sum().backward()
            times.append(time.perf_counter() - start)
        ms = statistics.median(times) * 1e3
        print(f"{name:<16} {ms:>10.1f} {sum(seen.values()) / 2**20:>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--capacity", type=int, default=2048)
    parser.add_argument("--attention", action="store_true", help="the packed-attention table")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.attention:
        return attention(args.batch, args.seq_len, args.repeats)
    print(f"{'items':>8} {'seconds':>8} {'blocks':>7} {'bound':>7} {'fill':>6}")
    for n in args.items:
        rng = random.Random(0)
        sizes = [rng.randint(1, args.capacity) for _ in range(n)]
        start = time.perf_counter()
        bins = best_fit_decreasing(sizes, args.capacity)
        seconds = time.perf_counter() - start
        total = sum(sizes)
        bound = math.ceil(total / args.capacity)
        fill = total / (len(bins) * args.capacity)
        print(f"{n:>8} {seconds:>8.3f} {len(bins):>7} {bound:>7} {fill:>6.1%}")


if __name__ == "__main__":
    main()
