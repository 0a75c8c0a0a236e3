"""Typed errors for everything a user can get wrong.

A `HomelabError` is printed by the front ends as two lines, ``error: …`` and ``hint: …``, and
ends the command with its ``exit_code`` — never with a traceback.
"""

from __future__ import annotations


class HomelabError(Exception):
    """A problem the user can fix: bad input, a missing file, an impossible request."""

    exit_code = 2

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class PresetError(HomelabError):
    """A preset that cannot be read or validated. ``problems`` holds every problem found."""

    def __init__(self, message: str, hint: str = "", problems: list[str] | None = None) -> None:
        super().__init__(message, hint)
        self.problems = problems or [message]


class ModelSpecError(HomelabError):
    """A model folder or config.json that cannot be planned for."""


class DataError(HomelabError):
    """A dataset that is missing, empty or does not match its declared format."""


class HardwareSpecError(HomelabError):
    """A bad ``--gpus`` what-if spec or an unusable device selection."""


class RunNotFoundError(HomelabError):
    """An unknown run id."""


class RunStateError(HomelabError):
    """A run that cannot do what was asked in its current state (e.g. resume a completed run)."""


class RunFailedError(HomelabError):
    """The training run itself failed (exit code 1, not a user mistake)."""

    exit_code = 1
