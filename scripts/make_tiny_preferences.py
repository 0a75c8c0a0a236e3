#!/usr/bin/env python
"""Write the demo preference data in ``assets/data/`` (for ``presets/tiny-dpo.toml``).

    python scripts/make_tiny_preferences.py     # writes assets/data/tiny-preferences.jsonl
                                                # and assets/data/tiny-kto.jsonl

The questions are those of the demo sets (`make_demo_data.py`: the invented atlas, arithmetic,
unit conversions, homelab questions), so the tiny model has seen their kind. Each pair follows
one rule a tiny model learns in a few dozen steps: the chosen answer is the right one, stated
plainly; the rejected answer hedges ("Not sure, maybe …") and gives the answer of another
question. Deterministic for a given ``--seed``; synthetic and the project's own (Apache-2.0).

Files (one JSON object a line):

- ``tiny-preferences.jsonl``  {"prompt", "chosen", "rejected"}   96 pairs
- ``tiny-kto.jsonl``          {"prompt", "completion", "label"}  96 records, half desirable
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_demo_data import SEED, _qa, make_world  # noqa: E402  (the demo sets' questions)

ROOT = Path(__file__).resolve().parent.parent
PAIRS = 96
_HEDGES = ("Not sure, maybe", "No idea, perhaps", "Hard to say, maybe")


def _prompt(question: str) -> str:
    """The prompt the completion format joins the answer to (the answer starts with a space)."""
    return f"Question: {question}\nAnswer:"


def preference_records(seed: int = SEED, n: int = PAIRS) -> list[dict]:
    """``n`` pairs: a right, plain answer chosen over a hedged answer to another question."""
    rng = random.Random(seed + 11)
    world = make_world(seed)
    qa = []
    seen: set[str] = set()
    while len(qa) < n:
        q, a = _qa(rng, world)
        if q not in seen and len(q) + len(a) < 120:  # short: the demo runs in seconds
            seen.add(q)
            qa.append((q, a))
    out = []
    for i, (q, a) in enumerate(qa):
        other = qa[(i + 1 + rng.randrange(n - 1)) % n][1]  # never its own answer
        wrong = other[0].lower() + other[1:]
        out.append(
            {"prompt": _prompt(q), "chosen": f" {a}", "rejected": f" {rng.choice(_HEDGES)} {wrong}"}
        )
    return out


def kto_records(pairs: list[dict], seed: int = SEED) -> list[dict]:
    """The pairs as KTO records: each prompt once, with its chosen answer (label true) or its
    rejected one (false), alternately, so half are desirable."""
    rng = random.Random(seed + 12)
    out = []
    for i, p in enumerate(pairs):
        good = i % 2 == 0
        out.append(
            {
                "prompt": p["prompt"],
                "completion": p["chosen" if good else "rejected"],
                "label": good,
            }
        )
    rng.shuffle(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "assets" / "data")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pairs = preference_records(args.seed)
    for name, records in (
        ("tiny-preferences.jsonl", pairs),
        ("tiny-kto.jsonl", kto_records(pairs, args.seed)),
    ):
        path = args.out / name
        with path.open("w", encoding="utf-8", newline="\n") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        print(f"{path}: {len(records)} records, {path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
