"""`homelab-dp probe`: the GPUs (or the CPU host when there is no GPU)."""

from __future__ import annotations

import argparse
from typing import Any

from homelab_dp.cli.common import EXIT_OK, print_json, print_rich


def register(sub: Any) -> None:
    """Add `probe` to the main parser's subparsers."""
    p = sub.add_parser("probe", help="the GPUs (or the CPU host when there is no GPU)")
    p.add_argument("--json", action="store_true", help="one JSON document")
    p.set_defaults(func=cmd_probe)


def cmd_probe(args: argparse.Namespace) -> int:
    from homelab_dp.app.probe import probe_machine

    report = probe_machine()
    if args.json:
        print_json(report.to_json())
    else:
        from homelab_dp.render.probe import render_probe

        print_rich(render_probe(report))
    return EXIT_OK
