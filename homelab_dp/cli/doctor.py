"""`homelab-dp doctor`: is this machine ready to train? Driver, torch, cards, NCCL, links,
bitsandbytes, disk, RAM, /dev/shm, open files."""

from __future__ import annotations

import argparse
from typing import Any

from homelab_dp.cli.common import EXIT_FAILED, EXIT_OK, print_json, print_rich


def register(sub: Any) -> None:
    """Add `doctor` to the main parser's subparsers."""
    p = sub.add_parser(
        "doctor", help="is this machine ready to train? (driver, torch build, cards, NCCL, disk)"
    )
    p.add_argument("--json", action="store_true", help='one JSON document: {"checks": [...]}')
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from homelab_dp.app import doctor

    checks = doctor.run_checks(doctor.gather())
    if args.json:
        print_json({"checks": [c.to_json() for c in checks]})
    else:
        from homelab_dp.render.doctor import render_doctor

        print_rich(render_doctor(checks))
    return EXIT_FAILED if doctor.failed(checks) else EXIT_OK
