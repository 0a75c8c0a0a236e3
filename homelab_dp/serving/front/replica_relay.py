"""Sending a generation to a replica, and trying another when the replica dies under it.

The balancer picks the replica; a connection that fails, an answer that ends before its
final line (the replica died), or a status that says the replica is not serving (401/404: not
our replica; 502/503/504) marks that replica suspect and sends the request again to another
ready one, waiting up to ``wait_s`` for one to be ready. Any other refusal (a 400 about the
request, a 500 of the replica's handler) is about the request, not the replica: it is passed
to the client at once, never tried again elsewhere (the same request would fail the same way
on every replica). So no client sees an error
while a replica is ready, except a streamed answer whose first piece already went out: that
one ends with `ReplicaGone` (the front sends an error event).

Which replica takes the next request: the least loaded ready one (pure bookkeeping).

The pick is the ready replica with the fewest requests in flight; ties go to the one that has
taken the fewest requests so far, then to the lowest id, so an idle server still spreads
sequential requests over every replica. The counts are per replica id and survive a restart
(the id is the slot, the process behind it may change).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing, suppress
from dataclasses import dataclass
from typing import Any

import aiohttp

from homelab_dp.serving.front.openai_api import error_body
from homelab_dp.serving.front.replica_supervisor import Supervisor


@dataclass
class Load:
    """One replica's counts."""

    in_flight: int = 0
    """Requests sent to it and not finished yet."""
    requests: int = 0
    """Requests sent to it in total (retries included: each try counts where it went)."""


class Balancer:
    """Least-in-flight load balancing over replica ids."""

    def __init__(self, ids: Iterable[int]) -> None:
        self.loads: dict[int, Load] = {i: Load() for i in ids}

    def pick(self, ready: Iterable[int]) -> int | None:
        """The replica among ``ready`` that should take the next request; None if none is."""
        candidates = [i for i in ready if i in self.loads]
        if not candidates:
            return None
        return min(candidates, key=lambda i: (self.loads[i].in_flight, self.loads[i].requests, i))

    def begin(self, replica: int) -> None:
        """A request was sent to ``replica``."""
        load = self.loads[replica]
        load.in_flight += 1
        load.requests += 1

    def end(self, replica: int) -> None:
        """A request sent to ``replica`` is over (answered, failed or abandoned)."""
        load = self.loads[replica]
        load.in_flight = max(0, load.in_flight - 1)

    def acquire(self, ready: Iterable[int]) -> int | None:
        """Pick a replica and count the request on it (`pick` then `begin`)."""
        chosen = self.pick(ready)
        if chosen is not None:
            self.begin(chosen)
        return chosen


MAX_TRIES = 8
"""Tries of one request (each on a replica that was ready when picked)."""
NOT_SERVING = (401, 404, 502, 503, 504)
"""Statuses that say the replica (not the request) is at fault: try another."""


class Unavailable(Exception):
    """No replica could take the request (none ready within the wait, or shutting down)."""


class ReplicaGone(Exception):
    """The replica died in the middle of an answer that could not be sent again."""


class Refused(Exception):
    """The replica refused the request (its 4xx/5xx status and body pass through)."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"replica answered {status}")
        self.status = status
        self.body = body


class Dispatcher:
    """Requests to replicas: pick, send, read the NDJSON lines, retry on a dead replica."""

    def __init__(
        self,
        supervisor: Supervisor,
        balancer: Balancer,
        session: aiohttp.ClientSession,
        *,
        wait_s: float = 30.0,
    ) -> None:
        self.supervisor = supervisor
        self.balancer = balancer
        self.session = session
        self.wait_s = wait_s
        self.closing = False

    async def _open(self, body: dict[str, Any]) -> tuple[int, aiohttp.ClientResponse]:
        """A replica answering 200 to ``POST /generate`` (its lines not read yet)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        for _ in range(MAX_TRIES):
            while True:
                changed = self.supervisor.changed()
                if self.closing:
                    raise Unavailable("the server is shutting down")
                rid = self.balancer.acquire(self.supervisor.ready_ids())
                if rid is not None:
                    break
                remaining = deadline - loop.time()
                if self.supervisor.all_failed() or remaining <= 0:
                    raise Unavailable(f"no replica is ready (waited {self.wait_s:g} s)")
                # Wake at a change of state, and look again at least every second.
                with suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(remaining, 1.0))
            try:
                resp = await self.session.post(
                    self.supervisor.url(rid, "/generate"),
                    json=body,
                    headers=self.supervisor.headers(),
                )
            except (aiohttp.ClientError, OSError):
                self.balancer.end(rid)
                self.supervisor.suspect(rid)
                continue
            if resp.status == 200:
                return rid, resp
            try:
                doc = await resp.json(content_type=None)
            except (aiohttp.ClientError, OSError, ValueError):
                doc = None
            finally:
                resp.release()
                self.balancer.end(rid)
            if resp.status in NOT_SERVING:
                # Not an answer about the request: our token, not a replica, or not serving.
                self.supervisor.suspect(rid)
                continue
            if not isinstance(doc, dict) or not isinstance(doc.get("error"), dict):
                kind = "server_error" if resp.status >= 500 else "invalid_request_error"
                doc = error_body(f"the replica refused the request ({resp.status})", type=kind)
            raise Refused(resp.status, doc)
        raise Unavailable(f"no replica answered after {MAX_TRIES} tries")

    async def _lines(self, rid: int, resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
        """The replica's NDJSON lines up to the final one; ReplicaGone if it ends before."""
        finished = False
        try:
            async for raw in resp.content:
                if not raw.strip():
                    continue
                doc = json.loads(raw)
                if not isinstance(doc, dict):
                    raise ValueError("not an object")
                if "error" in doc:  # the replica's generation failed: not a dead replica
                    finished = True
                    error = doc["error"]
                    raise Refused(
                        500,
                        {"error": error}
                        if isinstance(error, dict)
                        else error_body(str(error), type="server_error"),
                    )
                finished = "finish_reason" in doc
                yield doc
                if finished:
                    return
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            self.supervisor.suspect(rid)
            raise ReplicaGone(f"replica {rid} stopped mid-answer ({type(exc).__name__})") from None
        finally:
            if finished:
                resp.release()
            else:
                resp.close()  # the replica sees the client gone and drops the sequence
            self.balancer.end(rid)
        self.supervisor.suspect(rid)
        raise ReplicaGone(f"replica {rid} ended its answer early")

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """The whole answer: ``{"text", "finish_reason", "usage"}``, sent again from the start
        on another replica if one dies under it."""
        for _ in range(MAX_TRIES):
            rid, resp = await self._open(body)
            parts: list[str] = []
            try:
                async with aclosing(self._lines(rid, resp)) as lines:
                    async for doc in lines:
                        if "finish_reason" in doc:
                            return {"text": "".join(parts), **doc}
                        parts.append(str(doc.get("text", "")))
            except ReplicaGone:
                continue
        raise Unavailable(f"every replica failed this request ({MAX_TRIES} tries)")

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The replica's lines as they come; sent again elsewhere if a replica dies before the
        first line went out, ReplicaGone if after."""
        for _ in range(MAX_TRIES):
            rid, resp = await self._open(body)
            started = False
            try:
                async with aclosing(self._lines(rid, resp)) as lines:
                    async for doc in lines:
                        started = True
                        yield doc
                return
            except ReplicaGone:
                if started:
                    raise
        raise Unavailable(f"every replica failed this request ({MAX_TRIES} tries)")
