"""The top of `homelab-dp`: build the parser from the command modules, dispatch, map errors.

Each command group is a module with ``register(subparsers)``, which adds its parser and sets
``func`` (the function that runs it and returns the exit code): probe, doctor, plan, pull,
measure, presets, runs (run, runs, status, attach, stop, resume), and the result's use: eval,
chat, serve and export. With no command, the TUI opens.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from homelab_dp.cli import (
    bench,
    chat,
    doctor,
    evaluate,
    export,
    measure,
    plan,
    presets,
    probe,
    pull,
    runs,
    serve,
    sweep,
)
from homelab_dp.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    RUNS_COMMANDS,
    Parser,
    add_runs_option,
    use_runs_option,
)
from homelab_dp.errors import HomelabError
from homelab_dp.render.errors import error_text

DESCRIPTION = (
    "`homelab-dp`: the headless command line (argparse + rich). Thin: no logic of its own."
)
COMMANDS = (
    probe, doctor, plan, pull, measure, presets, runs, sweep, evaluate, bench, chat, serve, export,
)  # fmt: skip
"""The command modules, in the order `homelab-dp --help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The whole command-line contract: every command module's parsers under one."""
    parser = Parser(prog="homelab-dp", description=DESCRIPTION)
    add_runs_option(parser, top=True)  # also for the TUI: `homelab-dp --runs DIR`
    sub = parser.add_subparsers(dest="command", parser_class=Parser)
    for command in COMMANDS:
        command.register(sub)
    for name in RUNS_COMMANDS:  # one option, the same on every command that touches runs
        add_runs_option(sub.choices[name])
    return parser


def report_error(exc: HomelabError) -> int:
    """Print a user error as ``error:`` and ``hint:`` lines; return its exit code."""
    sys.stderr.write(error_text(exc) + "\n")
    return exc.exit_code


def quiet_libraries() -> None:
    """Keep the libraries' own chatter off a command's output: deprecation notices of
    transformers and peft (FutureWarning) and bitsandbytes' note that an optional CPU kernel
    package is missing. Their errors still show; the rank logs of a run keep everything."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `homelab-dp` console script."""
    quiet_libraries()
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    try:
        use_runs_option(args)  # a --runs folder that cannot be made: exit 2, nothing started
    except HomelabError as exc:
        return report_error(exc)
    if func is None:  # no command: the Textual TUI
        from homelab_dp.tui.tui_app import run_tui

        return run_tui()
    try:
        return func(args)
    except HomelabError as exc:
        return report_error(exc)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `homelab-dp runs --json | head`: the reader left early
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
