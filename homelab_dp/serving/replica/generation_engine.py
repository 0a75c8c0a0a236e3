"""A batched decoder with a KV cache: several requests generated together, each on its own terms.

`Engine.generate` takes a batch of `Request`s and runs it to the end:

- **prefill**: the prompts, left-padded to one length, go through the model once, with an
  ``attention_mask`` (padding is never attended) and ``position_ids`` that start at 0 at each
  prompt's first real token, so a padded row computes what it would alone;
- **decode**: one token per running row per step through the model's forward with the
  ``DynamicCache`` (past keys and values), the mask growing by one column a step. A row that
  finishes leaves the batch at once (its cache rows are dropped), so the others go on without it
  and the batch ends when every row has finished.

Per row: greedy (``temperature`` 0) or sampling with ``temperature`` and ``top_p`` from a
``torch.Generator`` of its own (seeded by ``seed``: a seeded request gives the same answer
whatever else shares its batch); stops at an eos token (``finish_reason`` "stop", the eos not in
the text), at one of its ``stop`` strings (the text ends before it) or at ``max_tokens`` /
the context ("length"); a cancelled request just leaves (nothing more is emitted).

One row's failure is that row's alone: a request the engine cannot run (no prompt, a seed
``torch.Generator`` refuses, a temperature whose logits overflow float32), or whose sampling or
text decoding raises, ends with one ``{"error": ...}`` event (its `Result`'s finish_reason
``error``) and leaves the batch, which goes on. What fails the whole batch (the forward pass:
out of memory, a token id past the vocabulary) raises; `Batcher` then tries each request alone.

Text reaches the request's ``emit`` callback incrementally: each step decodes the row's whole
answer and emits the new suffix, holding back a trailing U+FFFD (a multi-byte character whose
bytes have not all arrived) and any tail that could be the start of a stop string. The last
event is ``{"finish_reason": ..., "usage": {...}}``; every other is ``{"text": delta}``.

Dynamic batching: one thread generates, taking every waiting request as one batch.

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

import inspect
import math
import queue
import secrets
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from homelab_dp.planning.serve_plan import MIN_TEMPERATURE

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Event = dict[str, Any]
ROW_ERRORS = (ValueError, RuntimeError, OverflowError, TypeError, IndexError)
"""What one row's own work (seeding, sampling, decoding its text) may raise."""


def _ignore(_event: Event) -> None:
    pass


@dataclass
class Request:
    """One generation: a tokenized prompt and how to answer it."""

    prompt_ids: list[int]
    """The prompt's token ids (special tokens included)."""
    max_tokens: int
    """Most tokens to generate (clipped to what the context leaves)."""
    temperature: float = 0.0
    """0: greedy; else the softmax temperature."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p."""
    seed: int | None = None
    """Seeds this request's own generator (reproducible sampling); None: a random seed."""
    stop: tuple[str, ...] = ()
    """Strings that end the answer (not included in it)."""
    emit: Callable[[Event], None] = _ignore
    """Receives ``{"text": delta}`` events, then one ``{"finish_reason", "usage"}`` event.
    Called from the generating thread."""
    cancelled: threading.Event = field(default_factory=threading.Event)
    """Set it (from any thread) to stop generating this request; nothing more is emitted."""


@dataclass
class Result:
    """What a request produced."""

    text: str
    """The answer's text (stop string and eos excluded)."""
    token_ids: list[int]
    """The generated tokens (an eos that ended it included)."""
    finish_reason: str
    """``stop`` (eos or a stop string), ``length`` (max_tokens or context), ``cancelled``, or
    ``error`` (this row failed; the others went on)."""
    prompt_tokens: int
    """Tokens in the prompt."""

    @property
    def usage(self) -> dict[str, int]:
        """Token counts as the protocol reports them."""
        done = len(self.token_ids)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done,
        }


class TextStream:
    """An answer's text as its tokens arrive: only what is safe to show, stopped at a stop string.

    Each `push` decodes the whole answer so far (a token may complete a character begun by the
    previous ones) and returns the new text, holding back a trailing U+FFFD (bytes of a
    character still to come) and any tail that could be the start of a stop string.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""
        """The answer so far (cut before a stop string once one appeared)."""
        self.sent = 0
        """Characters of ``text`` already returned."""
        self.stopped = False
        """A stop string appeared (``text`` ends before it)."""

    def push(self, token: int) -> str:
        """Add one token; the text it makes safe to show ("" if none yet)."""
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        found = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True
            return self.flush()
        return self._take(len(self.text) - self._held_back())

    def flush(self) -> str:
        """The rest of the text (the answer has ended)."""
        return self._take(len(self.text))

    def _held_back(self) -> int:
        if self.text.endswith("\ufffd"):
            return len(self.text) - len(self.text.rstrip("\ufffd"))
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent : upto], upto
        return delta


class _Row:
    """A request's running state: its tokens, its text stream, its sampler."""

    def __init__(self, req: Request, engine: Engine) -> None:
        self.req = req
        self.eos_ids = engine.eos_ids
        self.limit = min(req.max_tokens, engine.context - len(req.prompt_ids))
        self.tokens: list[int] = []
        self.stream = TextStream(engine.tokenizer, req.stop)
        self.finish: str | None = None
        self.generator: torch.Generator | None = None
        try:
            self._check(engine)
            if req.temperature > 0:
                self.generator = torch.Generator(device=engine.device)
                seed = req.seed if req.seed is not None else secrets.randbits(63)
                self.generator.manual_seed(seed)
        except ROW_ERRORS as exc:
            self.fail(exc)

    def _check(self, engine: Engine) -> None:
        """What the engine cannot run (checked here too: on CUDA, NaN probabilities are a
        device-side assert that would end every request, not an exception)."""
        req = self.req
        if not req.prompt_ids or len(req.prompt_ids) >= engine.context or req.max_tokens < 1:
            raise ValueError("a request needs 1..context-1 prompt tokens and max_tokens >= 1")
        t = req.temperature
        if not math.isfinite(t) or t < 0 or 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature {t!r}: 0 or at least {MIN_TEMPERATURE:g}")
        if not 0 <= req.top_p <= 1:  # (NaN fails this too)
            raise ValueError(f"top_p {req.top_p!r}: between 0 and 1")

    def fail(self, exc: BaseException) -> None:
        """End this row alone with an error event."""
        self.finish = "error"
        message = f"generation failed: {type(exc).__name__}: {exc}"
        self.req.emit(
            {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
        )

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token (a 0-d tensor, on the device) drawn from this row's 1-D logits."""
        assert self.generator is not None
        probs = torch.softmax(logits / self.req.temperature, dim=-1)
        if self.req.top_p >= 1.0:
            return torch.multinomial(probs, 1, generator=self.generator)[0]
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep a token while the mass before it is below top_p (the first always stays).
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= self.req.top_p
        drop[0] = False
        sorted_probs[drop] = 0.0
        return order[torch.multinomial(sorted_probs, 1, generator=self.generator)[0]]

    def add(self, token: int) -> None:
        """Take one generated token: emit the new text, decide whether the row is done."""
        self.tokens.append(token)
        if token in self.eos_ids:
            self._end("stop")
            return
        self._send(self.stream.push(token))
        if self.stream.stopped:
            self._end("stop")
        elif len(self.tokens) >= self.limit:
            self._end("length")

    def _send(self, delta: str) -> None:
        if delta:
            self.req.emit({"text": delta})

    def _end(self, reason: str) -> None:
        self._send(self.stream.flush())
        self.finish = reason
        self.req.emit({"finish_reason": reason, "usage": self.result().usage})

    def result(self) -> Result:
        return Result(
            self.stream.text,
            list(self.tokens),
            self.finish or "cancelled",
            len(self.req.prompt_ids),
        )


class Engine:
    """Generates batches of requests with one model (used from one thread at a time)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        *,
        context: int,
        eos_ids: set[int],
        device: torch.device | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.context = context
        self.eos_ids = set(eos_ids)
        self.device = (
            torch.device(device) if device is not None else next(model.parameters()).device
        )
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        # transformers 5.2x names the cache argument `cache` (`past_key_values` is deprecated
        # there); older releases only know `past_key_values`. Models with their own code may
        # not take `logits_to_keep` (then every position's logits are computed).
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def _new_cache(self) -> Any:
        """An empty KV cache; given the config, sliding-window layers keep only their window."""
        from transformers import DynamicCache

        if "config" in inspect.signature(DynamicCache.__init__).parameters:
            return DynamicCache(config=self.model.config)
        return DynamicCache()

    @torch.inference_mode()
    def generate(self, requests: list[Request]) -> list[Result]:
        """Run the batch to its end; one `Result` per request, in order (a row that failed
        alone has finish_reason ``error``; a failure of the whole batch raises)."""
        rows = [_Row(req, self) for req in requests]
        running = [i for i, r in enumerate(rows) if r.finish is None]  # batch row -> rows index
        if not running:
            return [row.result() for row in rows]
        ids, mask = self._left_padded([rows[i].req.prompt_ids for i in running])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = self._new_cache()
        logits = self._forward(ids, mask, positions, cache)
        next_pos = positions[:, -1] + 1
        while True:
            for i, token in zip(
                running, self._pick([rows[i] for i in running], logits), strict=True
            ):
                row = rows[i]
                if row.finish is not None:  # its sampling failed
                    continue
                if row.req.cancelled.is_set():
                    row.finish = "cancelled"
                    continue
                try:
                    row.add(token)
                except ROW_ERRORS as exc:
                    row.fail(exc)
            keep = [b for b, i in enumerate(running) if rows[i].finish is None]
            if not keep:
                break
            if len(keep) < len(running):  # finished rows leave the batch and the cache
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                mask, next_pos = mask[index], next_pos[index]
                running = [running[b] for b in keep]
            step = torch.tensor([[rows[i].tokens[-1]] for i in running], device=self.device)
            mask = torch.cat([mask, mask.new_ones((len(running), 1))], dim=1)
            logits = self._forward(step, mask, next_pos[:, None], cache)
            next_pos = next_pos + 1
        return [row.result() for row in rows]

    def _pick(self, rows: list[_Row], logits: torch.Tensor) -> list[int]:
        """Each row's next token: greedy rows by one argmax, sampling rows by their generator;
        one copy to the host for the whole batch (a single device sync per step)."""
        greedy = logits.argmax(dim=-1)
        chosen = []
        for b, row in enumerate(rows):
            if row.generator is None:
                chosen.append(greedy[b])
                continue
            try:
                chosen.append(row.sample(logits[b]))
            except ROW_ERRORS as exc:  # this row alone: the others still get their token
                row.fail(exc)
                chosen.append(greedy[b])
        return torch.stack(chosen).tolist()

    def _left_padded(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[b, width - len(p) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """The last position's logits (float32) of each row, the cache extended."""
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **self.last_only,
            **{self.cache_arg: cache},
        )
        return out.logits[:, -1, :].float()


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
