"""`homelab-dp measure`: a few real steps, their memory measured against the plan."""

from __future__ import annotations

import argparse
from typing import Any

from homelab_dp.cli.common import EXIT_OK, print_json, print_rich


def register(sub: Any) -> None:
    """Add `measure` to the main parser's subparsers."""
    p = sub.add_parser("measure", help="run a few real steps and measure memory against the plan")
    p.add_argument("preset", help="a preset file or the name of one")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps to measure (default 3)")
    p.add_argument("--gpus", help="cpu:N measures on N CPU processes")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true", help="one JSON document")
    p.add_argument("--force", action="store_true", help="measure even if the plan does not fit")
    p.add_argument("--no-store", action="store_true", help="do not keep the result for later plans")
    p.set_defaults(func=cmd_measure)


def cmd_measure(args: argparse.Namespace) -> int:
    from homelab_dp.app.measure import measure

    report = measure(args.preset, steps=args.steps, gpus=args.gpus, overrides=args.set,
                     force=args.force, store=not args.no_store)  # fmt: skip
    if args.json:
        print_json(report.to_json())
    else:
        from homelab_dp.render.measure import render_measure

        print_rich(render_measure(report))
    return EXIT_OK
