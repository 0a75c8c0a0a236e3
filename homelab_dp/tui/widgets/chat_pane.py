"""One side of the Chat screen: a model's conversation, its answer growing as tokens stream."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from homelab_dp.app.chat_session import ChatSession


class ChatPane(VerticalScroll):
    """A transcript (prompts and answers) and its `ChatSession` (the conversation sent with the
    next prompt)."""

    def __init__(self, title: str, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="chat-pane")
        self.border_title = title
        self.session = ChatSession()
        """The conversation; the screen gives it its back end (a local server)."""
        self.answer = ""
        """The answer being streamed (or the last one)."""
        self._done = Text()
        self._note = ""
        self._streaming = False

    @property
    def history(self) -> list[dict[str, str]]:
        """The conversation so far, as the chat API takes it (without the system prompt)."""
        return self.session.turns

    def compose(self) -> ComposeResult:
        yield Static(classes="chat-transcript")

    def _show(self) -> None:
        shown = self._done.copy()
        if self._streaming:
            shown.append(self.answer)
        if self._note:
            shown.append(f"\n{self._note}", style="italic bright_black")
        self.query_one(".chat-transcript", Static).update(shown)
        self.scroll_end(animate=False)

    def ask(self, prompt: str) -> None:
        """Show the prompt, start an empty answer (the session keeps the turn)."""
        self._done.append("you ", style="bold cyan").append(f"{prompt}\n")
        self._done.append("model ", style="bold green")
        self.answer, self._note, self._streaming = "", "", True
        self._show()

    def add(self, piece: str) -> None:
        """A streamed piece of the answer."""
        self.answer += piece
        self._show()

    def finish(self, error: str | None = None) -> None:
        """The answer is complete (or was cut by ``error``; the session has dropped the turn)."""
        self._streaming = False
        self._done.append(self.answer)
        if error:
            self._done.append(f"\n[{error}]", style="bold red")
        self._done.append("\n\n")
        self._note = ""
        self._show()

    def note(self, text: str) -> None:
        """A passing state under the transcript ("starting the model…"); empty clears it."""
        self._note = text
        self._show()

    def reset(self, title: str | None = None) -> None:
        """Forget the conversation (``/reset``, or another model)."""
        if title is not None:
            self.border_title = title
        self.session.reset()
        self.answer, self._note, self._streaming = "", "", False
        self._done = Text()
        self._show()
