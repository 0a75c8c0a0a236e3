"""`homelab-dp bench MODEL --tasks NAMES|FILE.yaml`: lm-evaluation-harness, data-parallel."""

from __future__ import annotations

import argparse
from typing import Any

from homelab_dp.cli.common import EXIT_OK, print_json, print_rich


def register(sub: Any) -> None:
    """Add `bench` to the main parser's subparsers."""
    p = sub.add_parser("bench", help="lm-evaluation-harness tasks on a model (data-parallel)")
    p.add_argument(
        "model",
        help="a run id, a run folder (its result), a model folder or a Hugging Face id "
        "(org/name, from the local cache)",
    )
    p.add_argument(
        "--tasks",
        required=True,
        help="comma-separated lm_eval task names (their data in the HF cache) and/or task "
        ".yaml files (a relative data_files is read from the file's folder)",
    )
    p.add_argument("--limit", type=int, help="documents per task at most (default: all)")
    p.add_argument(
        "--gpus",
        help="cpu:N runs N CPU processes, 0,1 those GPUs (default: every visible GPU, else "
        "one CPU process)",
    )
    p.add_argument(
        "--base",
        action="store_true",
        help="bench the run's base model instead (stored as the run's bench-base.json)",
    )
    p.add_argument(
        "--trust-task-code",
        action="store_true",
        help="let the task files run Python code (!function, a class, a custom dataset, a "
        "metric script, unsandboxed templates); without it such a file is refused. Only for "
        "task files you have read",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='one JSON document: {"model", "tasks": {task: {metric: value, '
        '"<metric>_stderr": value}}, "seconds", ...}',
    )
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    """Check everything, run lm_eval under torchrun (`app.bench`), print the result."""
    from homelab_dp.app.bench import bench_model

    doc = bench_model(args.model, args.tasks, args.limit, args.gpus, args.base,
                      trust_code=args.trust_task_code)  # fmt: skip
    if args.json:
        print_json(doc)
    else:
        from homelab_dp.render.bench import render_bench

        print_rich(render_bench(doc))
    return EXIT_OK
