"""The messages screens and background threads post up to the app, which handles them.

Screens never reach into the app's state: what they need (the session, the controller, the
followed run) is handed to them when the app builds them, and what they want done to the app
as a whole they ask for here.
"""

from __future__ import annotations

from textual.message import Message

from homelab_dp.app.follow import Snapshot
from homelab_dp.errors import HomelabError


class RunUpdated(Message):
    """A followed run changed. Carries a whole snapshot, so a newer one replaces a pending one."""

    def __init__(self, snapshot: Snapshot) -> None:
        super().__init__()
        self.snapshot = snapshot

    def can_replace(self, message: Message) -> bool:
        """Coalesce: of several pending updates of the same run, only the newest is handled."""
        return isinstance(message, RunUpdated) and message.snapshot.run_id == self.snapshot.run_id


class FollowRun(Message):
    """Follow this run in the Monitor (instead of the one followed so far) and show it."""

    def __init__(self, run_id: str) -> None:
        super().__init__()
        self.run_id = run_id


class UserError(Message):
    """Show a user error as a notification, worded as the CLI words it (safe from a thread)."""

    def __init__(self, error: HomelabError) -> None:
        super().__init__()
        self.error = error
