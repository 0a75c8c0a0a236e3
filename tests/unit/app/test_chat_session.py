"""`ChatSession`: the conversation both front ends keep, whichever back end answers it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from homelab_dp.app.chat_server import ServerFailed
from homelab_dp.app.chat_session import ChatSession
from homelab_dp.errors import HomelabError


class _Server:
    """A server's answers, as `app.chat_server.LocalServer.stream` gives them."""

    def __init__(self, pieces: list[str], fail: bool = False) -> None:
        self.pieces, self.fail, self.sent = pieces, fail, []

    async def stream(
        self, messages: list[dict[str, str]], *, temperature: float, max_tokens: int
    ) -> AsyncIterator[str]:
        self.sent.append((messages, temperature, max_tokens))
        for piece in self.pieces:
            yield piece
        if self.fail:
            raise ServerFailed("the server stopped answering")


async def _collect(session: ChatSession, text: str) -> str:
    return "".join([piece async for piece in session.stream(text)])


def test_a_streamed_turn_is_kept_and_a_failed_one_is_not() -> None:
    session = ChatSession(_Server(["4", "."]), system="be brief", temperature=0.0, max_tokens=9)
    assert asyncio.run(_collect(session, "2+2?")) == "4."
    assert session.turns == [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4."},
    ]
    session.backend = failing = _Server(["half"], fail=True)
    with pytest.raises(ServerFailed):
        asyncio.run(_collect(session, "and 3+3?"))
    assert len(session.turns) == 2  # the failed turn is not sent with the next message
    messages, temperature, max_tokens = failing.sent[0]
    assert messages[0] == {"role": "system", "content": "be brief"} and len(messages) == 4
    assert (temperature, max_tokens) == (0.0, 9)
    session.reset()
    assert session.turns == [] and session.messages() == [messages[0]]


def test_an_in_process_answer_and_a_refused_message() -> None:
    class _Model:
        def answer(self, session: ChatSession, on_text) -> SimpleNamespace:
            if len(session.turns[-1]["content"]) > 5:
                raise HomelabError("the message takes 9 tokens", hint="send a shorter message")
            on_text("hi")
            return SimpleNamespace(text="hi", finish_reason="length")

    session = ChatSession(_Model())
    shown: list[str] = []
    assert session.ask("hello", shown.append) == "length" and shown == ["hi"]
    with pytest.raises(HomelabError):
        session.ask("far too long", shown.append)
    assert [t["content"] for t in session.turns] == ["hello", "hi"]
