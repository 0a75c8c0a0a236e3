"""`ChatSession`: the conversation both front ends keep, whichever back end answers it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest

from homelab_dp.app.chat_server import ChatServer, LocalServer, ServerFailed
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


def test_an_answer_stops_waiting_once_the_server_process_has_exited(tmp_path: Path) -> None:
    """A server killed while its socket is still open leaves a request unanswered: the stream
    watches the process and fails as soon as it is gone, rather than wait forever."""

    async def scenario() -> str:
        silent = await asyncio.start_server(  # accepts and never answers, as a dying server can
            lambda reader, writer: None, "127.0.0.1", 0
        )
        server = ChatServer("unused", log=tmp_path / "server.log", cpu=True)
        server.port = silent.sockets[0].getsockname()[1]
        server.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        (tmp_path / "server.log").write_text("error: the model ran out of memory\n")
        try:
            async with aiohttp.ClientSession() as http:
                messages = [{"role": "user", "content": "hi"}]
                stream = LocalServer(server, http).stream(messages, temperature=0, max_tokens=4)
                pending = asyncio.ensure_future(anext(stream))
                await asyncio.sleep(1.0)
                assert not pending.done()  # the live server is waited for
                server.proc.kill()
                with pytest.raises(ServerFailed) as failed:
                    await asyncio.wait_for(pending, 30)  # liveness: it fails within a poll
                return str(failed.value)
        finally:
            server.proc.kill()
            server.proc.wait()
            silent.close()

    message = asyncio.run(scenario())
    assert message == "the server exited: error: the model ran out of memory"
