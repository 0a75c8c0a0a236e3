"""Best-fit-decreasing packing: time and fill for seeded ragged sample lengths.

    python benchmarks/packing.py [--items 1000 10000 100000] [--capacity 2048]

Prints, per item count: the seconds `best_fit_decreasing` takes, the blocks it opens, the lower
bound (total length / capacity, rounded up) and the fill (total length / block capacity). The
unit test bounds the 100k case only as a liveness guard; this is where the figure lives.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--capacity", type=int, default=2048)
    args = parser.parse_args()
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
