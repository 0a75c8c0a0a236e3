"""`homelab-dp eval`: a model's loss and perplexity on a data set (on preference pairs: the DPO
loss and rewards against a reference), data-parallel."""

from __future__ import annotations

import argparse
from typing import Any

from homelab_dp.cli.common import EXIT_OK, print_json, print_rich


def register(sub: Any) -> None:
    """Add `eval` to the main parser's subparsers."""
    p = sub.add_parser(
        "eval",
        help="loss and perplexity of a model on a data set; on preference pairs the DPO loss, "
        "reward accuracy and margin against its base",
    )
    p.add_argument(
        "model",
        help="a run id, a run folder (its result), a model folder or a Hugging Face id (org/name)",
    )
    p.add_argument(
        "--data",
        required=True,
        help="a data file (.jsonl .json .csv .parquet .txt), a folder of them, or a dataset id",
    )
    p.add_argument(
        "--format",
        default="auto",
        help="auto | text | completion | instruction | chat | sharegpt | preference",
    )
    p.add_argument("--split", default="train", help="the split of a folder or dataset id (train)")
    p.add_argument(
        "--seq-len",
        type=int,
        help="tokens per sample at most (default: the run's, else min(2048, the model's positions))",
    )
    p.add_argument(
        "--gpus",
        help="cpu:N evaluates on N CPU processes, 0,1 on those GPUs (default: every visible GPU, "
        "else one CPU process)",
    )
    p.add_argument(
        "--reference",
        help="preference pairs: the model the rewards compare with (default: an adapter's base "
        "with the adapters disabled, a run's starting model; required for a plain model folder)",
    )
    p.add_argument("--json", action="store_true", help="one JSON document")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    """Check everything, evaluate under torchrun (`app.evaluate`), print the result."""
    from homelab_dp.app.evaluate import evaluate_model

    report = evaluate_model(
        args.model,
        args.data,
        args.format,
        args.seq_len,
        args.gpus,
        split=args.split,
        reference=args.reference,
    )
    if args.json:
        print_json(report.to_json())
    else:
        from homelab_dp.render.evaluate import render_eval

        print_rich(render_eval(report))
    return EXIT_OK
