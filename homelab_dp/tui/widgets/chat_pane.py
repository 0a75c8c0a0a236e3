"""One side of the Chat screen: a model's conversation, its answer growing as tokens stream."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static


class ChatPane(VerticalScroll):
    """A transcript (prompts and answers) and the conversation sent with the next prompt."""

    def __init__(self, title: str, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="chat-pane")
        self.border_title = title
        self.history: list[dict[str, str]] = []
        """The conversation so far, as the chat API takes it (without the system prompt)."""
        self.answer = ""
        """The answer being streamed (or the last one)."""
        self._done = Text()
        self._note = ""
        self._streaming = False

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

    def ask(self, prompt: str) -> list[dict[str, str]]:
        """Show the prompt, start an empty answer; returns the conversation to send."""
        self.history.append({"role": "user", "content": prompt})
        self._done.append("you ", style="bold cyan").append(f"{prompt}\n")
        self._done.append("model ", style="bold green")
        self.answer, self._note, self._streaming = "", "", True
        self._show()
        return list(self.history)

    def add(self, piece: str) -> None:
        """A streamed piece of the answer."""
        self.answer += piece
        self._show()

    def finish(self, error: str | None = None) -> None:
        """The answer is complete (or was cut by ``error``): it joins the conversation."""
        self._streaming = False
        self._done.append(self.answer)
        if error:
            self._done.append(f"\n[{error}]", style="bold red")
            self.history.pop()  # a failed turn is not part of the conversation sent next
        else:
            self.history.append({"role": "assistant", "content": self.answer})
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
        self.history.clear()
        self.answer, self._note, self._streaming = "", "", False
        self._done = Text()
        self._show()
