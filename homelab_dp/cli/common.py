"""What every command module shares: exit codes, the argument parser, printing a result."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from homelab_dp.render.errors import error_lines

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


class Parser(argparse.ArgumentParser):
    """argparse with our error format: ``error: …`` then ``hint: …``, exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        hint = f"see `{self.prog} --help`"
        sys.stderr.write(error_lines([f"{self.prog}: {message}"], hint) + "\n")
        raise SystemExit(EXIT_BAD_INPUT)


def print_json(doc: Any) -> None:
    """One indented JSON document on stdout (the ``--json`` output of a command)."""
    print(json.dumps(doc, indent=2))


def print_rich(renderable: Any) -> None:
    """A rendering for people (rich is imported only when a command prints one)."""
    from rich.console import Console

    Console().print(renderable)
