"""The memory model against measured peaks of live tensor bytes, on a grid of tiny models (CPU).

    python benchmarks/memory_accuracy.py [--steps 3] [--only SUBSTRING ...] [--held-out] [--json]

Families: LLaMA-style with grouped-query attention, Qwen2-style with tied embeddings and q/k/v
biases, Mixture-of-Experts Qwen3-MoE (8 experts, top-2), Mixtral and gpt-oss (4 experts, top-2; also
with LoRA, the experts frozen), GPT-2
(dropout 0.1, hence SDPA's math kernel on the CPU); activation checkpointing off and
on; five micro-batch × seq_len shapes, one with accumulation; padded batches. Full fine-tune in
fp32 with DDP on a one-process gloo group and foreach AdamW — the worker's own functions
(`homelab_dp.measure.memcheck`). Each case prints the planner's predicted peak of tensor memory
(weights + gradients + optimizer + activations + logits + buffers), the measured peak over the
steps, the error (estimate − measured) / measured and the phase of each peak. Exits 1 when a
case is off by more than 10%. ``--held-out`` runs the held-out grid after it (families and
shapes the measured constants were never fitted on, `memcheck.HELD_OUT_GRID`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from homelab_dp.measure.memcheck import (  # noqa: E402
    GRID,
    HELD_OUT_GRID,
    measure_case,
    table,
    to_json,
)

BOUND = 0.10


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per case")
    parser.add_argument("--only", nargs="*", default=[], help="cases whose name contains one")
    parser.add_argument("--json", action="store_true", help="JSON lines instead of the table")
    parser.add_argument("--held-out", action="store_true", help="the held-out grid too")
    args = parser.parse_args(argv)
    grid = GRID + HELD_OUT_GRID if args.held_out else GRID
    cases = [c for c in grid if not args.only or any(s in c.name for s in args.only)]
    t0 = time.perf_counter()
    results = [measure_case(c, steps=args.steps) for c in cases]
    print(to_json(results) if args.json else table(results))
    if not args.json:
        print(f"{len(results)} cases in {time.perf_counter() - t0:.0f} s (torch CPU, fp32)")
    return 1 if any(abs(r.error) > BOUND for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
