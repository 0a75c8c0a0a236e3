"""User errors shown in the TUI with exactly the CLI's wording (``error: …`` / ``hint: …``)."""

from __future__ import annotations

from homelab_dp.errors import HomelabError


def error_text(exc: HomelabError) -> str:
    """The lines `homelab-dp` prints for this error: one ``error:`` per problem, then ``hint:``."""
    problems = getattr(exc, "problems", None) or [exc.message]
    lines = [f"error: {problem}" for problem in problems]
    if exc.hint:
        lines.append(f"hint: {exc.hint}")
    return "\n".join(lines)
