"""User errors as both front ends word them: one ``error: …`` line per problem, then ``hint: …``.

The CLI prints these lines on stderr (`homelab_dp.cli.main.report_error`, argparse's errors);
the TUI shows the same lines in a notification. Stdlib only: the CLI's JSON paths use it.
"""

from __future__ import annotations

from collections.abc import Iterable

from homelab_dp.errors import HomelabError


def error_lines(problems: Iterable[str], hint: str | None = None) -> str:
    """``error: …`` for each problem, then ``hint: …`` when there is one (no final newline)."""
    lines = [f"error: {problem}" for problem in problems]
    if hint:
        lines.append(f"hint: {hint}")
    return "\n".join(lines)


def error_text(exc: HomelabError) -> str:
    """The lines `homelab-dp` prints for this error: one ``error:`` per problem, then ``hint:``."""
    return error_lines(getattr(exc, "problems", None) or [exc.message], exc.hint)
