"""The OpenAI-compatible front: an aiohttp application over the replicas, and `serve`.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` and
``GET /health``. With an API key, every one of them (``/health`` too: it shows pids and
devices) needs ``Authorization: Bearer KEY`` (the scheme in any case, RFC 7235), else 401 with
OpenAI's error body (a header that is not ASCII included). ``/health`` answers 200 while a
replica is ready and 503 otherwise, with the same body, so that an outside load balancer can
use it as it is; a replica that stops answering its heartbeat shows as ``unresponsive``.

Every error is a JSON body, a handler's unexpected exception too (500, its traceback on stderr).
A request aiohttp cannot parse (a NUL or another forbidden byte in a header or the URL, a header
line over `MAX_HEADER_BYTES`, more than `MAX_HEADERS` headers, not HTTP) is a 400 from aiohttp's
parser, logged as one line naming the kind of fault and the client, never the bytes it sent (an
Authorization header's key would be among them) and never a traceback (`ParseErrorLog`).
A request has `REQUEST_TIMEOUT_S` (``--request-timeout``) to be answered, else 504. Request
bodies are read within a shared memory budget and a time limit (`homelab_dp.serving.front.request_guards`).

`serve` binds first, then starts the replicas, prints one line on stdout once every replica is
ready (or failed for good), and on SIGTERM (exit 0) or Ctrl-C / SIGINT (exit 130) stops taking
requests, gives the ones in flight `DRAIN_S`, and stops every replica process.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any

import aiohttp
from aiohttp import http_exceptions, web

from homelab_dp.serving.front import openai_api as api
from homelab_dp.serving.front.replica_relay import (
    Balancer,
    Dispatcher,
    Refused,
    ReplicaGone,
    Unavailable,
)
from homelab_dp.serving.front.replica_supervisor import ReplicaLaunch, Supervisor
from homelab_dp.serving.front.request_guards import (
    BODIES_BUDGET,
    BODY_TIMEOUT_S,
    BODY_WAIT_S,
    SMALL_BODY,
    BodyBudget,
    parse_bearer,
)

DRAIN_S = 2.0
"""How long requests in flight may finish after a stop signal."""
MAX_BODY = 8 * 1024 * 1024
"""The largest request body (a long conversation); larger is a 413."""
REQUEST_TIMEOUT_S = 600.0
"""The default deadline of one request, from its body read to its last byte (then 504)."""
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_HEADER_BYTES = 8190
"""The longest request line, header name or header value aiohttp's parser takes (400 above)."""
MAX_HEADERS = 64
"""The most headers one request may carry (400 above); clients send about ten."""
HTTP_LOG = "homelab_dp.serve.http"
"""The logger aiohttp's request handler writes to (`ParseErrorLog` keeps sent bytes out)."""
_PARSE_FAULTS: tuple[tuple[type[Exception], str], ...] = (
    (http_exceptions.LineTooLong, f"a request line or header over {MAX_HEADER_BYTES} bytes"),
    (http_exceptions.InvalidURLError, "a URL with a forbidden character"),
    (http_exceptions.BadHttpMethod, "not an HTTP request"),
    (http_exceptions.BadStatusLine, "a malformed request line"),
    (http_exceptions.InvalidHeader, "a malformed header"),
    (http_exceptions.BadHttpMessage, "a malformed header or request"),
    (http_exceptions.HttpProcessingError, "a malformed request"),
)


class ParseErrorLog(logging.Filter):
    """Rewrites aiohttp's "Error handling request" record for a request its parser refused:
    one warning line naming the fault's kind and the client. aiohttp's own record carries a
    traceback whose message quotes the bytes received (a header with the API key in it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, http_exceptions.HttpProcessingError):
            return True
        kind = next(what for cls, what in _PARSE_FAULTS if isinstance(exc, cls))
        client = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        record.msg = "serve: refused a request from %s: %s (HTTP %s; its bytes are not logged)"
        record.args = (client, kind, exc.code)
        record.exc_info = record.exc_text = None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def http_log() -> logging.Logger:
    """The logger given to aiohttp's request handler: `ParseErrorLog` on it, once."""
    log = logging.getLogger(HTTP_LOG)
    if not any(isinstance(f, ParseErrorLog) for f in log.filters):
        log.addFilter(ParseErrorLog())
    return log


def make_runner(app: web.Application) -> web.AppRunner:
    """The app's runner with the header limits and the request handler's logger set."""
    return web.AppRunner(
        app,
        access_log=None,
        shutdown_timeout=DRAIN_S,
        logger=http_log(),
        max_line_size=MAX_HEADER_BYTES,
        max_field_size=MAX_HEADER_BYTES,
        max_headers=MAX_HEADERS,
    )


def _error(status: int, message: str, **fields: Any) -> web.Response:
    return web.json_response(api.error_body(message, **fields), status=status)


class Front:
    """What the handlers share: the model's name, the replicas, the balancer, the key."""

    def __init__(
        self,
        name: str,
        supervisor: Supervisor,
        dispatcher: Dispatcher,
        *,
        api_key: str | None = None,
        request_timeout: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.name = name
        self.supervisor = supervisor
        self.dispatcher = dispatcher
        self.balancer = dispatcher.balancer
        self.api_key = api_key
        self.request_timeout = request_timeout
        self.created = int(time.time())
        self.bodies = BodyBudget(BODIES_BUDGET)

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application(middlewares=[self._middleware], client_max_size=MAX_BODY)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        return app

    def _authorized(self, request: web.Request) -> bool:
        if self.api_key is None:
            return True
        return parse_bearer(request.headers.get("Authorization", ""), self.api_key)

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The API key, and OpenAI's error body for every error (ours and aiohttp's)."""
        if not self._authorized(request):
            return _error(
                401,
                "Incorrect or missing API key: send `Authorization: Bearer KEY`",
                code="invalid_api_key",
            )
        try:
            return await handler(request)
        except api.ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        except web.HTTPException as exc:  # unknown path, wrong method, body too large
            if exc.status < 400:
                raise
            return _error(exc.status, f"{request.method} {request.path}: {exc.reason}")
        except (ConnectionError, asyncio.CancelledError):
            raise  # the client left: nobody to answer
        except Exception:  # noqa: BLE001 - a bug of ours: a JSON 500, the traceback on stderr
            traceback.print_exc()
            return _error(500, "internal error (see the server's log)", type="server_error")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        """The request's JSON object, its reading bounded in memory and in time."""
        size = request.content_length
        if size is not None and size > MAX_BODY:
            raise api.ApiError(
                f"the request body ({size} bytes) is over {MAX_BODY} bytes", status=413
            )
        if size is not None and size <= SMALL_BODY:
            raw = await self._read(request)
        else:
            async with self.bodies.reserve(size or MAX_BODY, BODY_WAIT_S):
                raw = await self._read(request)
        return api.parse_json(raw)

    async def _read(self, request: web.Request) -> bytes:
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                return await request.read()
        except ConnectionError:  # the client left mid-body: its buffer goes, nobody to answer
            raise api.ApiError("the request body was cut (the connection closed)") from None
        except TimeoutError:
            raise api.ApiError(
                f"the request body did not arrive within {BODY_TIMEOUT_S:g} s", status=408
            ) from None

    def replicas(self) -> list[dict[str, Any]]:
        """/health's replicas: the supervisor's view with the balancer's counts."""
        rows = self.supervisor.report()
        for row in rows:
            load = self.balancer.loads[row["id"]]
            row["requests"], row["in_flight"] = load.requests, load.in_flight
        return rows

    def status(self) -> str:
        """ok (a replica is ready), unresponsive (none is, and one stopped answering its
        heartbeat), starting, or unavailable (every replica failed)."""
        if self.supervisor.ready_ids():
            return "ok"
        if self.supervisor.all_failed():
            return "unavailable"
        states = {r.state for r in self.supervisor.replicas}
        return "unresponsive" if "unresponsive" in states else "starting"

    async def health(self, request: web.Request) -> web.Response:
        """``GET /health``: the status and every replica's id, device, pid, state and counts."""
        status = self.status()
        doc = {"status": status, "model": self.name, "replicas": self.replicas()}
        return web.json_response(doc, status=200 if status == "ok" else 503)

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the one model served."""
        return web.json_response(api.models_list(self.name, self.created))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``."""
        generation = api.parse_completion(await self._body(request))
        return await self._generate(request, generation)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``."""
        generation = api.parse_chat(await self._body(request))
        return await self._generate(request, generation)

    def _check(self, generation: api.Generation) -> None:
        """The model asked for, and max_tokens against the context (the replica checks the
        prompt's tokens too)."""
        api.check_model(generation, self.name)
        context = self.supervisor.context()
        api.check_prompt_size(generation, context)
        if generation.max_tokens is not None and context and generation.max_tokens >= context:
            raise api.ApiError(
                f"max_tokens ({generation.max_tokens}) is beyond the model's context "
                f"({context} tokens, the prompt included)",
                param="max_tokens",
            )

    async def _generate(
        self, request: web.Request, generation: api.Generation
    ) -> web.StreamResponse:
        self._check(generation)
        if generation.stream:
            return await self._stream(request, generation)
        try:
            async with asyncio.timeout(self.request_timeout):
                answer = await self.dispatcher.complete(generation.replica_body())
        except Refused as exc:
            return web.json_response(exc.body, status=exc.status)
        except Unavailable as exc:
            return _error(503, str(exc), type="server_error", code="unavailable")
        except TimeoutError:
            return self._timed_out()
        doc = api.response(
            generation.kind,
            id=api.new_id(generation.kind),
            created=int(time.time()),
            model=self.name,
            text=answer["text"],
            finish_reason=answer["finish_reason"],
            usage=answer["usage"],
        )
        return web.json_response(doc)

    def _timed_out(self) -> web.Response:
        return _error(
            504,
            f"no answer within {self.request_timeout:g} s (the request's deadline)",
            type="server_error",
            code="timeout",
        )

    async def _stream(self, request: web.Request, generation: api.Generation) -> web.StreamResponse:
        """Server-sent events, started at the replica's first line: a refusal, no replica or
        the deadline before it is still a plain HTTP error; the deadline after it ends the
        stream with an error event."""
        events = EventStream(request)
        try:
            try:
                async with asyncio.timeout(self.request_timeout):
                    refused = await self._relay(events, generation)
            except TimeoutError:
                if events.response is None:
                    return self._timed_out()
                body = api.error_body(
                    f"the answer was cut at the request's deadline ({self.request_timeout:g} s)",
                    type="server_error",
                    code="timeout",
                )
                await events.send(api.sse(body) + api.SSE_DONE)
                refused = None
            if refused is not None:
                return refused
            assert events.response is not None
            await events.response.write_eof()
        except ConnectionResetError:
            pass  # the client left: closing its lines dropped the request on the replica too
        assert events.response is not None
        return events.response

    async def _relay(self, events: EventStream, generation: api.Generation) -> web.Response | None:
        """The replica's lines as chunks, [DONE] last; an error before the first one as the
        HTTP response to send instead, after it as an error event."""
        kind = generation.kind
        meta = dict(id=api.new_id(kind), created=int(time.time()), model=self.name)
        try:
            async with aclosing(self.dispatcher.stream(generation.replica_body())) as lines:
                async for doc in lines:
                    if events.response is None and kind == "chat":
                        await events.send(api.sse(api.chunk(kind, **meta, role=True, text="")))
                    if "finish_reason" in doc:
                        reason, usage = doc["finish_reason"], doc.get("usage")
                        last = api.chunk(kind, **meta, finish_reason=reason, usage=usage)
                        await events.send(api.sse(last) + api.SSE_DONE)
                    else:
                        text = doc.get("text", "")
                        await events.send(api.sse(api.chunk(kind, **meta, text=text)))
        except Refused as exc:
            if events.response is None:
                return web.json_response(exc.body, status=exc.status)
            await events.send(api.sse(exc.body) + api.SSE_DONE)
        except Unavailable as exc:
            if events.response is None:
                return _error(503, str(exc), type="server_error", code="unavailable")
            await events.send(api.sse(api.error_body(str(exc), type="server_error")) + api.SSE_DONE)
        except ReplicaGone as exc:  # only after the first line: before, another replica took it
            body = api.error_body(f"the answer was cut: {exc}", type="server_error")
            await events.send(api.sse(body) + api.SSE_DONE)
        return None


class EventStream:
    """A server-sent-events answer whose HTTP response starts with its first event."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    async def send(self, data: bytes) -> None:
        """Write events (starting the response at the first)."""
        if self.response is None:
            self.response = web.StreamResponse(headers=SSE_HEADERS)
            await self.response.prepare(self.request)
        await self.response.write(data)


def ready_line(name: str, host: str, port: int, labels: Sequence[str]) -> str:
    """The one line printed on stdout once every replica is ready."""
    where = f"[{host}]" if ":" in host else host
    n = len(labels)
    return f"serving {name} on http://{where}:{port}/v1 with {n} replica{'s' * (n != 1)} ({', '.join(labels)})"


async def _serve(
    model: str,
    name: str,
    launches: Sequence[ReplicaLaunch],
    *,
    host: str,
    port: int,
    api_key: str | None,
    max_batch: int | None,
    sock: socket.socket | None,
    wait_s: float,
    engine: str,
    context: int | None,
    gpu_memory_utilization: float | None,
    request_timeout: float,
) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    interrupted = False

    def on_signal(sig: signal.Signals) -> None:
        nonlocal interrupted
        interrupted = interrupted or sig == signal.SIGINT
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    supervisor = Supervisor(
        model,
        launches,
        max_batch=max_batch,
        engine=engine,
        context=context,
        gpu_memory_utilization=gpu_memory_utilization,
    )
    connector = aiohttp.TCPConnector(limit=1024)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        dispatcher = Dispatcher(supervisor, Balancer(range(len(launches))), session, wait_s=wait_s)
        front = Front(
            name, supervisor, dispatcher, api_key=api_key, request_timeout=request_timeout
        )
        runner = make_runner(front.app())
        await runner.setup()
        site = web.SockSite(runner, sock) if sock is not None else web.TCPSite(runner, host, port)
        watcher: asyncio.Task[None] | None = None
        try:
            await site.start()
            supervisor.start()
            watcher = asyncio.create_task(supervisor.watch(session))
            announced = False
            while not stop.is_set():
                if supervisor.all_failed():
                    sys.stderr.write(
                        "error: every replica failed; nothing to serve\n"
                        "hint: the replicas' last log lines above say why\n"
                    )
                    return 1
                if not announced and supervisor.settled():
                    labels = [r.launch.label for r in supervisor.replicas if r.state == "ready"]
                    print(ready_line(name, host, port, labels), flush=True)
                    announced = True
                waits = {
                    asyncio.ensure_future(stop.wait()),
                    asyncio.ensure_future(supervisor.changed().wait()),
                }
                await asyncio.wait([*waits, watcher], return_when=asyncio.FIRST_COMPLETED)
                for waiting in waits:
                    waiting.cancel()
                if watcher.done():
                    watcher.result()  # the watcher never ends by itself: raise what broke it
            return 130 if interrupted else 0
        finally:
            dispatcher.closing = True
            if watcher is not None:
                watcher.cancel()
            await runner.cleanup()
            supervisor.stop()
            supervisor.cleanup()


def serve(
    model: str,
    name: str,
    launches: Sequence[ReplicaLaunch],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_batch: int | None = None,
    sock: socket.socket | None = None,
    wait_s: float = 30.0,
    engine: str = "transformers",
    context: int | None = None,
    gpu_memory_utilization: float | None = None,
    request_timeout: float = REQUEST_TIMEOUT_S,
) -> int:
    """Serve ``model`` (a folder replicas can load) as ``name`` until SIGTERM or Ctrl-C.

    ``sock``: an already bound listening socket for ``host:port`` (the CLI binds it first so a
    taken port is an error before anything starts). ``engine``: the replicas' kind
    (``transformers`` or ``vllm``); ``context`` and ``gpu_memory_utilization`` go to vLLM
    replicas (see `Supervisor`). ``request_timeout``: each request's deadline (504 after it).
    Returns the exit code: 0 after SIGTERM,
    130 after Ctrl-C / SIGINT, 1 if every replica failed.
    """
    return asyncio.run(
        _serve(
            model,
            name,
            launches,
            host=host,
            port=port,
            api_key=api_key,
            max_batch=max_batch,
            sock=sock,
            wait_s=wait_s,
            engine=engine,
            context=context,
            gpu_memory_utilization=gpu_memory_utilization,
            request_timeout=request_timeout,
        )
    )
