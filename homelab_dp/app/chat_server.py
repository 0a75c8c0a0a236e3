"""A background `serve` of one model for the TUI's Chat screen, and a streamed chat request to it:
the local-server back end of a `app.chat_session.ChatSession` (`LocalServer`).

The TUI never loads torch nor initialises CUDA (it stays responsive while a run trains), so a
model is tried through `homelab-dp serve MODEL --replicas 1` in its own process group on a free
loopback port, its output in a log file of a private folder. The screen waits for ``GET
/health`` to say ready and streams ``POST /v1/chat/completions`` (server-sent events) with
aiohttp on its own event loop. Stopping sends SIGTERM to the server's process group (the front
and its replica), then SIGKILL if it lingers. No Textual here.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from homelab_dp.probe.visible_gpus import cuda_device_env
from homelab_dp.supervise.launcher import free_port  # a loopback port free now

STOP_WAIT_S = 5.0
"""How long a stopped server may take to exit before its group is killed."""
HEALTH_POLL_S = 0.25

_LIVE: set[ChatServer] = set()


class ServerFailed(Exception):
    """The server exited or answered with an error; the message says why in one line."""

    def __init__(self, message: str, *, lost: bool = False) -> None:
        """``lost``: the connection failed (the server may be exiting), not an error answer."""
        super().__init__(message)
        self.lost = lost


class ChatServer:
    """One `serve` process (one replica) of one model."""

    def __init__(
        self,
        model: str,
        *,
        log: Path,
        cpu: bool,
        cuda_visible: str | None = None,
    ) -> None:
        """``model``: the MODEL argument; ``log``: where its output goes; ``cpu``: serve from
        one CPU process (no GPU here); ``cuda_visible``: the card it may use."""
        self.model = model
        self.log = log
        self.cpu = cpu
        self.cuda_visible = cuda_visible
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.replica_pids: list[int] = []
        """The replica processes /health reported once ready (the server's children)."""
        self.device = ""
        """Where the replica runs, as /health says ("cpu", "GPU 0 (…)")."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def command(self) -> list[str]:
        """The `serve` command line (the same a person would type)."""
        cmd = [sys.executable, "-m", "homelab_dp.cli", "serve", self.model,
               "--replicas", "1", "--host", "127.0.0.1", "--port", str(self.port)]  # fmt: skip
        return cmd + (["--gpus", "cpu:1"] if self.cpu else [])

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """The server's environment (the launcher's one rule, `probe.visible_gpus.cuda_device_env`):
        no card for a CPU server, ``cuda_visible`` where given (its NVML index counted in PCI
        bus order, as NVML counts), else ``base``'s own cards."""
        cards = [] if self.cpu else None if self.cuda_visible is None else [self.cuda_visible]
        return cuda_device_env(base, cards)

    def start(self) -> None:
        """Start the server in its own session (its own process group), output to the log."""
        self.port = free_port()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self.environment(os.environ), start_new_session=True,
            )  # fmt: skip
        self.started = time.monotonic()
        _LIVE.add(self)

    def exited(self) -> int | None:
        """The exit code once the server has exited, else None."""
        return None if self.proc is None else self.proc.poll()

    async def wait_exit(self, timeout_s: float) -> int | None:
        """The exit code once the server has exited, waiting up to ``timeout_s`` for it (a
        connection can fail before its dying process can be reaped, and on busy cores that
        takes a moment); None if it still runs."""
        deadline = time.monotonic() + timeout_s
        while (code := self.exited()) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return code

    def why(self) -> str:
        """Why a server that exited did, from its log: the first error line (the cause; a
        replica's own comes before the server's summary) and the last line, when they differ."""
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if not lines:
            return ""
        first = next((line for line in lines if line.startswith("error:")), lines[-1])
        return first if first == lines[-1] else f"{first} · {lines[-1]}"

    def exit_message(self, code: int) -> str:
        """One line for a server that exited with ``code``: why, from its log, else the code."""
        return f"the server exited: {self.why() or f'exit code {code}'}"

    async def wait_ready(self, session: aiohttp.ClientSession) -> None:
        """Poll /health until a replica is ready; ServerFailed if the server exits first."""
        while True:
            code = self.exited()
            if code is not None:
                raise ServerFailed(self.exit_message(code))
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                timeout = aiohttp.ClientTimeout(total=2)
                async with session.get(f"{self.url}/health", timeout=timeout) as resp:
                    doc = await resp.json(content_type=None)
                    if resp.status == 200 and doc.get("status") == "ok":
                        replicas = doc.get("replicas") or []
                        self.replica_pids = [int(r["pid"]) for r in replicas if r.get("pid")]
                        self.device = ", ".join(str(r.get("device", "")) for r in replicas)
                        return
            await asyncio.sleep(HEALTH_POLL_S)

    def terminate(self) -> None:
        """SIGTERM the server's process group (the front and its replica); returns at once."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)

    def stop(self) -> None:
        """Terminate the server and wait for it; SIGKILL its group after `STOP_WAIT_S`."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            self.terminate()
            try:
                proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        _LIVE.discard(self)


@dataclass
class LocalServer:
    """The local-server back end of a `ChatSession`: one running `ChatServer`, asked over HTTP."""

    server: ChatServer
    http: aiohttp.ClientSession

    def stream(
        self, messages: list[dict[str, str]], *, temperature: float, max_tokens: int
    ) -> AsyncIterator[str]:
        """The answer to ``messages``, its text pieces as they come; ServerFailed on an error,
        and as soon as the server's process has exited (a dying server can leave a request
        waiting on its socket)."""
        pieces = stream_chat(
            self.http, self.server.url, messages, temperature=temperature, max_tokens=max_tokens
        )
        return _until_exit(self.server, pieces)


async def _until_exit(server: ChatServer, pieces: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    """``pieces`` as they come, checking every `HEALTH_POLL_S` while none comes that the
    server still runs; ServerFailed (``lost``) once it has exited."""
    try:
        while True:
            step = asyncio.ensure_future(anext(pieces))
            while not (await asyncio.wait({step}, timeout=HEALTH_POLL_S))[0]:
                if (code := server.exited()) is not None:
                    step.cancel()
                    with contextlib.suppress(asyncio.CancelledError, ServerFailed):
                        await step
                    raise ServerFailed(server.exit_message(code), lost=True)
            try:
                piece = step.result()
            except StopAsyncIteration:
                return
            yield piece
    finally:
        with contextlib.suppress(ServerFailed, RuntimeError):
            await pieces.aclose()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@atexit.register
def _stop_all() -> None:
    """No server outlives the TUI, even when it ends without leaving the Chat screen."""
    for server in list(_LIVE):
        server.stop()


async def stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, str]],
    *,
    temperature: float,
    max_tokens: int,
) -> AsyncGenerator[str, None]:
    """The answer's text pieces as the server streams them; ServerFailed on an error."""
    body: dict[str, Any] = {"messages": messages, "temperature": temperature,
                            "max_tokens": max_tokens, "stream": True}  # fmt: skip
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, timeout=timeout) as resp:
            if resp.status != 200:
                raise ServerFailed(_error_text(await resp.text(), resp.status))
            async for raw in resp.content:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                doc = json.loads(data)
                if "error" in doc:
                    raise ServerFailed(_error_text(data, resp.status))
                for choice in doc.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        yield piece
    except aiohttp.ClientError as exc:
        raise ServerFailed(f"the server stopped answering ({exc})", lost=True) from None


def _error_text(body: str, status: int) -> str:
    """An OpenAI-style error body as one line."""
    try:
        doc = json.loads(body)
        return f"HTTP {status}: {doc['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {body.strip()[:200]}"
