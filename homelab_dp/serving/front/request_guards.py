"""What the front does before a request is trusted: the API key's check, and the memory and
time that request bodies being received may take.

Request bodies over `SMALL_BODY` bytes (as declared) share a budget of `BODIES_BUDGET` bytes
while they are received (a 503 when it stays full for `BODY_WAIT_S`); each body has
`BODY_TIMEOUT_S` to arrive (then 408, and the connection's buffer is released). So connections
that hold unfinished bodies cannot grow the front beyond the budget, and hold it for a bounded
time; small requests are never held up by large ones.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from homelab_dp.serving.front import openai_api as api

SMALL_BODY = 64 * 1024
"""Bodies up to this size (declared) are read without taking from the budget."""
BODIES_BUDGET = 64 * 1024 * 1024
"""Bytes of larger request bodies being received at once (declared sizes; a body without a
Content-Length counts as `MAX_BODY`): unfinished bodies cannot grow the front beyond it."""
BODY_WAIT_S = 5.0
"""How long a large body waits for room in the budget before a 503."""
BODY_TIMEOUT_S = 30.0
"""How long a body may take to arrive once its reading starts (then 408)."""


def parse_bearer(header: str, key: str) -> bool:
    """Whether an Authorization header carries ``Bearer key`` (the scheme in any case, RFC
    7235), compared in constant time. A header that is not ASCII (aiohttp hands its bytes over
    as surrogate escapes) never matches."""
    try:
        given = header.encode("ascii")
    except UnicodeEncodeError:
        return False
    scheme, _, token = given.strip().partition(b" ")
    ok_scheme = scheme.lower() == b"bearer"
    return hmac.compare_digest(token.strip(), key.encode()) and ok_scheme


class BodyBudget:
    """Bytes of request bodies being received at once, shared by every connection."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self._freed = asyncio.Condition()

    @asynccontextmanager
    async def reserve(self, size: int, wait_s: float) -> AsyncIterator[None]:
        """Hold ``size`` bytes while the body is read; `api.ApiError` 503 after ``wait_s``."""
        size = min(size, self.total)
        async with self._freed:
            try:
                await asyncio.wait_for(
                    self._freed.wait_for(lambda: self.used + size <= self.total), wait_s
                )
            except TimeoutError:
                raise api.ApiError(
                    "the server is receiving too many large requests; try again",
                    status=503,
                    type="server_error",
                    code="busy",
                ) from None
            self.used += size
        try:
            yield
        finally:
            async with self._freed:
                self.used -= size
                self._freed.notify_all()
