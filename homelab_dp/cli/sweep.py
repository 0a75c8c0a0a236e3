"""`homelab-dp sweep PRESET --grid KEY=V1,V2 ...`: plan every point of a grid, queue those that
fit as runs tagged with one sweep id (thin, over `homelab_dp.app.sweep`)."""

from __future__ import annotations

import argparse
from typing import Any

from homelab_dp.cli.common import print_json


def cmd_sweep(args: argparse.Namespace) -> int:
    from homelab_dp.app.runs import make_controller
    from homelab_dp.app.sweep import sweep
    from homelab_dp.render.compare import sweep_lines

    result = sweep(
        make_controller(),
        args.preset,
        args.grid,
        overrides=args.set,
        gpus=args.gpus,
        notify=args.notify,
    )
    if args.json:
        print_json(result.to_json())
    else:
        print("\n".join(sweep_lines(result.to_json())))
    return 0


def add_notify_option(p: argparse.ArgumentParser) -> None:
    """``--notify CMD``, the same on run, resume and sweep."""
    p.add_argument(
        "--notify",
        metavar="CMD",
        default=None,
        help="a shell command run once when the run ends, with HOMELAB_DP_RUN_ID, "
        "HOMELAB_DP_RUN_STATE, HOMELAB_DP_RUN_SUMMARY and HOMELAB_DP_RUN_DIR in its environment "
        "and the summary on stdin; 'desktop': notify-send. Default: notify.command in "
        "$XDG_DATA_HOME/homelab-dp/config.toml",
    )


def register(sub: Any) -> None:
    """Add `sweep` to the main parser's subparsers."""
    p = sub.add_parser("sweep", help="plan every point of a grid, then queue those that fit")
    p.add_argument("preset")
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a preset key and its values (repeat for more keys); replaces that key's values "
        "in the preset's [sweep] grid, other keys of the table stay",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--gpus", help="cpu:N runs every point on N CPU processes")
    p.add_argument("--json", action="store_true", help="the sweep id and every point as JSON")
    add_notify_option(p)
    p.set_defaults(func=cmd_sweep)
