"""`homelab-dp plan`: will it fit, and how to spread it (no torch: answers in milliseconds)."""

from __future__ import annotations

import argparse
from typing import Any

from homelab_dp.cli.common import EXIT_OK, print_json, print_rich


def register(sub: Any) -> None:
    """Add `plan` to the main parser's subparsers."""
    p = sub.add_parser("plan", help="will it fit, and how to spread it")
    p.add_argument("preset", help="a preset file or the name of one (homelab-dp presets list)")
    p.add_argument("--gpus", help="plan for other hardware: 2x24GiB, 24GiB,12GiB, cpu:2")
    p.add_argument("--json", action="store_true", help="one JSON document")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--find-micro-batch",
        action="store_true",
        help="the largest micro-batch that fits; accumulation keeps the effective batch",
    )
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from homelab_dp.core.preset_store import open_preset
    from homelab_dp.run.planning import make_plan

    preset = open_preset(args.preset, args.set)
    planned = make_plan(preset, args.gpus, find_micro_batch=args.find_micro_batch)
    if args.json:
        print_json(planned.plan.to_json())
    else:
        from homelab_dp.render.plan import render_plan

        print_rich(render_plan(planned.plan))
    return EXIT_OK  # whether or not it fits: the answer is in `fits`
