"""Dynamic batching: one thread generates, taking every waiting request as one batch.

Requests are submitted from any thread (the replica's event loop). The generating thread
blocks until one arrives, then takes it and every other request waiting or arriving within
`GATHER_S` (up to ``max_batch``) and decodes them together with `Engine.generate`; requests
that arrive later wait for the next batch.

One request never fails another: a row's own failure ends that row alone (`Engine.generate`);
when the batch as a whole fails (e.g. out of memory, or one prompt that breaks the forward
pass), each request that had not been answered yet is generated again alone, so only the one
that fails alone too ends with an ``{"error": ...}`` event (a request whose text had started
streaming cannot be started again: it ends with the error). The thread goes on with the next.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import replace

from homelab_dp.infer.engine import Engine, Event, Request

GATHER_S = 0.005
"""How long a new batch waits for more requests after its first: a burst of concurrent clients
reaches the generating thread over a few milliseconds (the event loop reads them one by one),
and without this the first would be decoded alone and the rest only after it."""


class Batcher:
    """The generating thread and its queue of waiting requests."""

    def __init__(self, engine: Engine, max_batch: int, gather_s: float = GATHER_S) -> None:
        self.engine = engine
        self.max_batch = max(1, max_batch)
        self.gather_s = gather_s if self.max_batch > 1 else 0.0
        self._waiting: queue.Queue[Request | None] = queue.Queue()
        self._active: list[Request] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="generate", daemon=True)
        self.batches = 0
        """Batches generated so far."""

    def start(self) -> None:
        """Start the generating thread."""
        self._thread.start()

    def submit(self, request: Request) -> None:
        """Queue a request for the next batch."""
        self._waiting.put(request)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what is running and waiting, and end the thread (waits ``timeout`` at most)."""
        with self._lock:
            for req in self._active:
                req.cancelled.set()
        while True:
            try:
                pending = self._waiting.get_nowait()
            except queue.Empty:
                break
            if pending is not None:
                pending.cancelled.set()
        self._waiting.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _next_batch(self) -> list[Request] | None:
        first = self._waiting.get()
        if first is None:
            return None
        batch = [first]
        deadline = time.monotonic() + self.gather_s
        while len(batch) < self.max_batch:
            try:
                more = self._waiting.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if more is None:  # stop: finish nothing
                return None
            batch.append(more)
        return [r for r in batch if not r.cancelled.is_set()]

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            if not batch:
                continue
            with self._lock:
                self._active = batch
            watched = [_Watched(req) for req in batch]
            try:
                self.engine.generate([w.request for w in watched])
            except Exception as exc:  # noqa: BLE001 - reported to the clients, the thread lives on
                traceback.print_exc()
                self._one_by_one(watched, exc)
            finally:
                with self._lock:
                    self._active = []
                self.batches += 1

    def _one_by_one(self, watched: list[_Watched], exc: Exception) -> None:
        """After a failed batch: each request not answered yet, alone (see the docstring)."""
        for w in watched:
            if w.ended or w.request.cancelled.is_set():
                continue
            if w.started or len(watched) == 1:
                _fail(w.request, exc)
                continue
            try:
                self.engine.generate([w.original])
            except Exception as alone:  # noqa: BLE001 - this request's own failure
                traceback.print_exc()
                _fail(w.original, alone)


class _Watched:
    """A request whose events are seen on their way: whether any went out, and the last."""

    def __init__(self, original: Request) -> None:
        self.original = original
        self.started = False
        self.ended = False
        self.request = replace(original, emit=self._emit)

    def _emit(self, event: Event) -> None:
        self.started = True
        self.ended = "finish_reason" in event or "error" in event
        self.original.emit(event)


def _fail(request: Request, exc: Exception) -> None:
    message = f"generation failed: {type(exc).__name__}: {exc}"
    request.emit(
        {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    )
