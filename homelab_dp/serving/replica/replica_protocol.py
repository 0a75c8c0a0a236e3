"""The replica protocol's process and HTTP side, shared by both replica kinds.

`serving.replica.transformers_replica` (transformers, our batcher) and `serving.replica.vllm_replica` (vLLM's engine) differ only
in how a checked request becomes a stream of events; everything the serve front relies on is
here, once:

- the command line both accept (`base_parser`) and the start-up checks (`check_setup`: the
  secret in ``HOMELAB_DP_REPLICA_TOKEN``, the state folder), an ``error:`` / ``hint:`` pair and
  exit 2 for bad input (`report`);
- the HTTP surface (`ReplicaServer`): the bearer-token middleware (401), ``GET /ready``, and
  ``POST /generate``, which checks the body (`request_body`), renders and tokenizes the prompt
  (`prompting`) and checks its length (HTTP 400 before anything streams), then writes the
  subclass's events as NDJSON until the ``finish_reason`` (or ``error``) line. A client that
  leaves mid-stream closes the subclass's event stream (its ``finally`` cancels the request);
- `run_until_stopped`: bind 127.0.0.1 on port 0, write ``replica-K.json`` atomically, then wait
  for SIGTERM/SIGINT and stop;
- while loading (before the event loop takes the signals), SIGTERM/SIGINT end the process at
  once (`leave_while_loading`);
- the front's death, at any moment of the replica's life (`watch_parent`): the kernel sends
  SIGTERM when the parent dies (``prctl(PR_SET_PDEATHSIG)`` on Linux), and a thread polls
  ``os.getppid()`` every `PARENT_POLL_S` against the front's pid (``HOMELAB_DP_FRONT_PID``, so a
  front that died while this process was still importing is noticed too). An orphaned replica
  removes its own files (and the state folder once empty) and exits. No pipe to the parent.

Requests are never trusted: the body must be strict JSON (`request_body.decode_json`), a
prompt too large for the context by its size is refused before tokenizing, and rendering and
tokenizing run in one worker thread of their own, off the event loop (other requests go on
streaming meanwhile). Whatever else a handler raises is a JSON 500, never a plain-text one.

The body of a replica's ``POST /generate``, checked before anything is generated.

Every problem is a `BadRequest` naming the field (``param``), which the replica answers with
HTTP 400 and an OpenAI-style error body. Fields not in the protocol are ignored (the front may
pass more than the replica uses); a known field of the wrong type is an error.

Defaults for absent (or null) fields: ``max_tokens`` up to the context, ``temperature`` 1.0
and ``top_p`` 1.0 (the OpenAI API's defaults), no ``stop`` strings, a random ``seed``.

The bounds are the front's (`homelab_dp.serving.front.openai_api`, which the replica cannot import):
nothing accepted here can fail in generation. A temperature between 0 and `MIN_TEMPERATURE`
(float32 logits / T overflow), a seed outside `SEED_RANGE` (``torch.Generator`` raises), a stop
string over `MAX_STOP_CHARS`, a string that is not valid Unicode (a lone surrogate) and a prompt
longer than the context can hold by its size alone (`check_size`, before tokenizing) are 400s;
`decode_json` refuses NaN/Infinity and nesting that exhausts the parser's recursion.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import hmac
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from homelab_dp import json_safe
from homelab_dp.errors import HomelabError
from homelab_dp.planning.serve_plan import (
    MAX_STOP_CHARS,
    MIN_TEMPERATURE,
    SEED_RANGE,
    request_size_problem,
)
from homelab_dp.runs.folder.run_folder import write_json_atomic
from homelab_dp.serving.replica.prompt_templates import Template, prompt_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant")


class BadRequest(Exception):
    """A request the replica refuses before generating (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        """The protocol's error body."""
        return {
            "error": {
                "message": self.message,
                "type": "invalid_request_error",
                "param": self.param,
                "code": None,
            }
        }


@dataclass(frozen=True)
class GenerateBody:
    """A checked /generate request (the prompt not yet tokenized)."""

    prompt: str | None
    """A raw prompt, or None when ``messages`` is given."""
    messages: list[dict[str, str]] | None
    """A conversation to render with the model's template, or None."""
    max_tokens: int | None
    """Most tokens to generate; None: up to the context."""
    temperature: float
    """0: greedy."""
    top_p: float
    """Nucleus sampling mass in [0, 1] (0 keeps only the most likely token)."""
    stop: tuple[str, ...]
    """Strings that end the answer (empty strings dropped)."""
    seed: int | None
    """Seed of this request's sampler."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def decode_json(raw: bytes) -> Any:
    """A request body as strict JSON (no NaN/Infinity); `BadRequest` for anything else,
    nesting deep enough to exhaust the parser's recursion included."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON ({exc})") from None
    except RecursionError:
        raise BadRequest("the request body is not valid JSON (nested too deeply)") from None


def _text(value: str, key: str) -> str:
    """``value``, if it is valid Unicode (a lone surrogate cannot be tokenized)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{key} is not valid Unicode (a lone surrogate)", key) from None
    return value


def _number(body: dict, key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"{key} must be a number", key)
    return float(value)


def _integer(body: dict, key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be an integer", key)
    return value


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}", "messages")
        if not isinstance(m.get("content"), str):
            raise BadRequest(f"messages[{i}].content must be a string", "messages")
        out.append({"role": m["role"], "content": _text(m["content"], "messages")})
    if all(m["role"] == "system" for m in out):
        raise BadRequest("messages needs at least one user or assistant message", "messages")
    return out


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise BadRequest("stop must be a string or a list of strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in value):
        raise BadRequest(f"stop strings must be at most {MAX_STOP_CHARS} characters", "stop")
    return tuple(_text(s, "stop") for s in value if s)


def parse_body(body: Any) -> GenerateBody:
    """Check a decoded JSON body; raises `BadRequest` naming the first bad field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise BadRequest("give exactly one of prompt and messages", "prompt")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string", "prompt")
        if not prompt:
            raise BadRequest("prompt is empty", "prompt")
        _text(prompt, "prompt")
    else:
        messages = _messages(messages)
    max_tokens = _integer(body, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest("max_tokens must be at least 1", "max_tokens")
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
        raise BadRequest(
            f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}", "temperature"
        )
    top_p = _number(body, "top_p", 1.0)
    if not 0 <= top_p <= 1:
        raise BadRequest("top_p must be between 0 and 1", "top_p")
    seed = _integer(body, "seed")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise BadRequest(f"seed must be within {SEED_RANGE[0]}..{SEED_RANGE[1]}", "seed")
    return GenerateBody(
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        stop=_stop(body.get("stop")),
        seed=seed,
    )


def check_size(body: GenerateBody, context: int) -> None:
    """`BadRequest` for a prompt too large for ``context`` tokens by its size alone
    (`planning.serve_plan.prompt_size_problem`), so that no tokenizer spends seconds on it."""
    found = request_size_problem(body.prompt, body.messages, context)
    if found:
        raise BadRequest(*found)


def check_length(prompt_tokens: int, max_tokens: int | None, context: int, source: str) -> int:
    """The max_tokens to use, or `BadRequest` when the prompt and answer exceed the context.

    ``source`` names the prompt's field (``prompt`` or ``messages``) for a prompt too long alone.
    """
    if prompt_tokens >= context:
        raise BadRequest(
            f"the prompt has {prompt_tokens} tokens; the model's context is {context}", source
        )
    if max_tokens is None:
        return context - prompt_tokens
    if prompt_tokens + max_tokens > context:
        raise BadRequest(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context of {context} tokens",
            "max_tokens",
        )
    return max_tokens


TOKEN_ENV = "HOMELAB_DP_REPLICA_TOKEN"
FRONT_PID_ENV = "HOMELAB_DP_FRONT_PID"
"""The serve front's pid (set by its supervisor): the parent this replica must outlive never."""
PARENT_POLL_S = 0.5
"""How often the parent watch looks at ``os.getppid()``."""
MAX_BODY = 8 * 1024 * 1024
"""The largest /generate body (the front's own limit)."""
PR_SET_PDEATHSIG = 1
Event = dict[str, Any]


def base_parser(prog: str) -> argparse.ArgumentParser:
    """The arguments every replica takes (the replica protocol's start line)."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--model", required=True, help="a run folder, model folder or adapter folder")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    p.add_argument("--id", type=int, required=True, help="this replica's number K")
    p.add_argument("--state-dir", type=Path, required=True, help="where replica-K.json goes")
    return p


def check_setup(args: argparse.Namespace) -> str:
    """The replica's secret, once the environment and ``--state-dir`` are usable; from here on
    the replica exits when its front is gone (`watch_parent`)."""
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise HomelabError(
            f"{TOKEN_ENV} is not set", hint="the serve front sets it; replicas need a secret"
        )
    if not args.state_dir.is_dir():
        raise HomelabError(f"--state-dir {args.state_dir}: no such folder")
    watch_parent(args.state_dir, args.id)
    return token


def report(exc: HomelabError) -> int:
    """Print ``error:`` (and ``hint:``) for the log; the exit code of bad input (2)."""
    print(f"error: {exc.message}", flush=True)
    if exc.hint:
        print(f"hint: {exc.hint}", flush=True)
    return 2


_parent = 0
"""The front's pid (`leave_while_loading`)."""
_own_files: tuple[Path, int] | None = None
"""This replica's state folder and id, once known (`watch_parent`)."""


def _orphaned() -> bool:
    return _parent > 0 and os.getppid() != _parent


def _leave_orphaned(why: str) -> None:
    """The front is gone: remove this replica's files and exit now."""
    print(f"replica: {why}; exiting", flush=True)
    if _own_files is not None:
        remove_own_files(*_own_files)
    exit_now(0)


def _leave(signum: int, _frame: Any) -> None:
    if _orphaned():
        _leave_orphaned(f"signal {signum} while loading, the front gone")
    print(f"replica: signal {signum} while loading; exiting", flush=True)
    os._exit(0)


def leave_while_loading() -> int:
    """SIGTERM/SIGINT end the process at once until the event loop takes them; the parent pid:
    the front's (``HOMELAB_DP_FRONT_PID``) when it set it, else the parent now."""
    global _parent
    try:
        _parent = int(os.environ.get(FRONT_PID_ENV, ""))
    except ValueError:
        _parent = os.getppid()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _leave)
    return _parent


def _die_with_parent() -> None:
    """Ask the kernel for SIGTERM when the parent dies (Linux; elsewhere the poll does it)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            print(f"replica: prctl failed (errno {ctypes.get_errno()}); polling only", flush=True)
    except (OSError, AttributeError) as exc:  # no libc prctl: the poll below still works
        print(f"replica: no prctl ({exc}); polling only", flush=True)


def _poll_parent() -> None:
    while True:
        if _orphaned():
            _leave_orphaned("parent process gone")
        time.sleep(PARENT_POLL_S)


def watch_parent(state_dir: Path, replica_id: int) -> None:
    """From now until the process ends: exit (removing this replica's files) once the front
    is gone, whether it died before this call or dies later (see the module docstring)."""
    global _own_files
    _own_files = (Path(state_dir), replica_id)
    _die_with_parent()
    if _orphaned():
        _leave_orphaned("the front was gone before the replica started")
    threading.Thread(target=_poll_parent, name="parent-watch", daemon=True).start()


def exit_now(code: int) -> None:
    """Leave without waiting for generating threads (they may be inside a forward pass)."""
    sys.stdout.flush()
    os._exit(code)


def write_ready_file(state_dir: Path, info: dict[str, Any]) -> Path:
    """Write ``replica-K.json`` atomically (a reader never sees half of it)."""
    path = state_dir / f"replica-{info['id']}.json"
    write_json_atomic(path, info)
    return path


def error_response(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    """An OpenAI-shaped error body with ``status``."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return web.json_response(body, status=status)


def server_error(message: str) -> Event:
    """The stream's last line when generation itself failed."""
    return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}


def is_last(event: Event) -> bool:
    """Whether ``event`` ends a stream (the finish line or an error)."""
    return "finish_reason" in event or "error" in event


@dataclass(frozen=True)
class Prepared:
    """A checked request, its prompt tokenized: what an engine needs to answer it."""

    body: GenerateBody
    """The checked body (sampling settings)."""
    prompt_ids: list[int]
    """The prompt's token ids, rendered with the model's template."""
    max_tokens: int
    """Tokens to generate at most (the body's, else what the context leaves)."""
    stop: tuple[str, ...]
    """The body's stop strings, then the template's."""


def prepare(
    body: Any, tokenizer: PreTrainedTokenizerBase, template: Template, context: int
) -> Prepared:
    """Check a decoded body, render and tokenize its prompt; a `BadRequest` names what is wrong
    (a prompt too large for ``context`` by its size is refused before the tokenizer sees it)."""
    parsed = parse_body(body)
    check_size(parsed, context)
    if parsed.messages is not None:
        ids = prompt_ids(tokenizer, messages=parsed.messages, template=template)
    else:
        ids = prompt_ids(tokenizer, prompt=parsed.prompt)
    source = "prompt" if parsed.prompt is not None else "messages"
    max_tokens = check_length(len(ids), parsed.max_tokens, context, source)
    return Prepared(parsed, ids, max_tokens, tuple(parsed.stop) + template.stop)


class ReplicaServer:
    """The HTTP side: checks requests and streams the events a subclass's `events` yields."""

    def __init__(
        self, token: str, tokenizer: PreTrainedTokenizerBase, template: Template, context: int
    ) -> None:
        self.token = f"Bearer {token}".encode()
        self.tokenizer = tokenizer
        self.template = template
        self.context = context
        self.in_flight = 0
        self.served = 0
        # One thread renders and tokenizes, off the event loop: a long prompt delays the next
        # prompt's tokenizing, never another request's streaming or /ready.
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    def events(self, prepared: Prepared) -> AsyncIterator[Event]:
        """Generate one request: ``{"text"}`` deltas, then a finish (or error) event.

        Closing the iterator early (the client left) must cancel the generation.
        """
        raise NotImplementedError

    def app(self) -> web.Application:
        """The aiohttp application: the two endpoints behind the bearer-token check."""

        @web.middleware
        async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
            header = request.headers.get("Authorization", "")
            given = header.encode("utf-8", errors="replace")  # odd bytes: no match, no crash
            if not hmac.compare_digest(given, self.token):
                return error_response(401, "missing or wrong bearer token", "authentication_error")
            try:
                return await handler(request)
            except BadRequest as exc:
                return web.json_response(exc.body(), status=400)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                return error_response(exc.status, exc.reason, "invalid_request_error")
            except (ConnectionError, asyncio.CancelledError):
                raise
            except Exception as exc:  # noqa: BLE001 - a JSON 500 for the front, the trace in the log
                traceback.print_exc()
                return error_response(500, f"the replica failed: {exc!r}"[:500], "server_error")

        app = web.Application(middlewares=[auth], client_max_size=MAX_BODY)
        app.router.add_get("/ready", self.ready)
        app.router.add_post("/generate", self.generate)
        return app

    async def ready(self, request: web.Request) -> web.Response:
        """``{"ok": true, "in_flight": n, "served": requests accepted so far}``."""
        return web.json_response({"ok": True, "in_flight": self.in_flight, "served": self.served})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """Stream one request's events as NDJSON (400 before streaming for a bad body)."""
        body = decode_json(await request.read())
        loop = asyncio.get_running_loop()
        prepared = await loop.run_in_executor(
            self.tokenizing, prepare, body, self.tokenizer, self.template, self.context
        )
        self.in_flight += 1
        self.served += 1
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        try:
            # aclosing: a write that fails (the client went) closes the stream, which cancels.
            async with contextlib.aclosing(self.events(prepared)) as events:
                await response.prepare(request)
                async for event in events:
                    await response.write(json_safe.dumps(event).encode() + b"\n")
                    if is_last(event):
                        break
            await response.write_eof()
        except ConnectionError:  # (a front's deadline passed while we could not answer)
            print("replica: client disconnected; its request is cancelled", flush=True)
        except asyncio.CancelledError:
            print("replica: client disconnected; its request is cancelled", flush=True)
            raise
        finally:
            self.in_flight -= 1
        return response  # (on a closed connection aiohttp drops it quietly)


async def run_until_stopped(
    server: ReplicaServer,
    args: argparse.Namespace,
    info: dict[str, Any],
    *,
    parent: int,
    on_stop: Callable[[], None],
) -> None:
    """Serve on 127.0.0.1 (port 0), announce it in ``replica-K.json``, run until SIGTERM/SIGINT
    (the kernel's, too, when ``parent`` dies; `watch_parent` also polls); then ``on_stop`` and
    close.

    ``info``: the ready file's fields besides ``id``, ``pid``, ``port`` and ``device``.
    """
    runner = web.AppRunner(server.app(), access_log=None, handle_signals=False)
    await runner.setup()
    # On stop, streams still open get half a second (aiohttp waits 60 s by default).
    site = web.TCPSite(runner, "127.0.0.1", 0, shutdown_timeout=0.5)
    await site.start()
    port = int(runner.addresses[0][1])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = {"id": args.id, "pid": os.getpid(), "port": port, "device": args.device, **info}
    write_ready_file(args.state_dir, ready)
    print(
        f"replica {args.id}: ready on 127.0.0.1:{port} ({info.get('model')} on {args.device})",
        flush=True,
    )
    await stop.wait()
    orphaned = os.getppid() != parent
    print(f"replica {args.id}: stopping", flush=True)
    on_stop()
    await runner.cleanup()
    if orphaned:  # the front was killed and cannot clean up: leave nothing in its folder
        remove_own_files(Path(args.state_dir), args.id)


def remove_own_files(state_dir: Path, replica_id: int) -> None:
    """Remove this replica's ready file and log, and the state folder once it is empty (the
    last orphaned replica out removes it)."""
    for name in (f"replica-{replica_id}.json", f"replica-{replica_id}.log"):
        (state_dir / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not empty yet: another replica's files remain
        state_dir.rmdir()
