"""What every command module shares: exit codes, the argument parser, the ``--runs`` option,
printing a result."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from homelab_dp import json_safe
from homelab_dp.render.errors import error_lines

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130

RUNS_COMMANDS = ("run", "runs", "status", "attach", "stop", "resume", "measure", "eval", "chat",
                 "serve", "export", "bench", "sweep")  # fmt: skip
"""The commands that read or make runs: each takes ``--runs DIR``."""
RUNS_HELP = (
    "the runs folder to use (created if missing); overrides $HOMELAB_DP_RUNS. Default: "
    "$HOMELAB_DP_RUNS, else ~/.local/share/homelab-dp/runs. A run is found by id from any "
    "folder without it (the per-user run index)"
)


class Parser(argparse.ArgumentParser):
    """argparse with our error format: ``error: …`` then ``hint: …``, exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        hint = f"see `{self.prog} --help`"
        sys.stderr.write(error_lines([f"{self.prog}: {message}"], hint) + "\n")
        raise SystemExit(EXIT_BAD_INPUT)


N = TypeVar("N", int, float)


def number_type(
    convert: Callable[[str], N], ok: Callable[[N], bool], kind: str, bound: str
) -> Callable[[str], N]:
    """An argparse ``type=`` that reads a number with ``convert`` and keeps it when ``ok``;
    otherwise "'TEXT' is not KIND" or "VALUE is not BOUND" (argparse shows either as the
    option's error, exit 2)."""

    def parse(text: str) -> N:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{value} is not {bound}")
        return value

    return parse


def add_runs_option(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """Add ``--runs DIR`` to ``parser``. On a subcommand it is SUPPRESSed when absent, so it
    never overwrites a ``--runs`` given before the command (``homelab-dp --runs DIR runs``)."""
    default = None if top else argparse.SUPPRESS
    parser.add_argument("--runs", metavar="DIR", default=default, help=RUNS_HELP)


def use_runs_option(args: argparse.Namespace) -> None:
    """Make ``--runs DIR`` the runs root of this process and of what it starts (it sets
    $HOMELAB_DP_RUNS, which the controller and `runs.model_ref` read). The folder is created
    0700; one that cannot be raises a HomelabError naming it, before anything starts."""
    folder = getattr(args, "runs", None)
    if not folder:
        return
    from homelab_dp.app.runs import use_runs_root

    use_runs_root(folder)


def print_json(doc: Any) -> None:
    """One indented JSON document on stdout (the ``--json`` output of a command)."""
    print(json_safe.dumps(doc, indent=2))


def print_rich(renderable: Any) -> None:
    """A rendering for people (rich is imported only when a command prints one)."""
    from rich.console import Console

    Console().print(renderable)
