"""Messages from background threads to the app."""

from __future__ import annotations

from textual.message import Message

from homelab_dp.tui.follower import Snapshot


class RunUpdated(Message):
    """A followed run changed. Carries a whole snapshot, so a newer one replaces a pending one."""

    def __init__(self, snapshot: Snapshot) -> None:
        super().__init__()
        self.snapshot = snapshot

    def can_replace(self, message: Message) -> bool:
        """Coalesce: of several pending updates of the same run, only the newest is handled."""
        return isinstance(message, RunUpdated) and message.snapshot.run_id == self.snapshot.run_id
