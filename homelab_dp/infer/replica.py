"""A replica: one copy of the model behind a small HTTP server on loopback (the serve front's unit).

    python -m homelab_dp.infer.replica --model MODEL --device DEVICE --id K --state-dir DIR
        [--max-batch B] [--threads T]            (env HOMELAB_DP_REPLICA_TOKEN=<secret>)

The protocol between the serve front and its replicas: it loads MODEL on DEVICE, runs a 1-token warm-up,
binds 127.0.0.1 on an ephemeral port and writes ``DIR/replica-K.json`` atomically; then

- ``GET /ready`` -> ``{"ok": true, "in_flight": n, "served": requests accepted so far}``;
- ``POST /generate`` -> an NDJSON stream of ``{"text": delta}`` lines and one last
  ``{"finish_reason", "usage"}`` line (or, when the generation itself fails, an
  ``{"error": {"message", "type": "server_error", ...}}`` line); a bad body is HTTP 400 with
  ``param`` (`request_body`);
- every request needs ``Authorization: Bearer <token>`` (else 401).

The aiohttp server runs in the main thread's event loop; generation runs in one thread
(`Batcher`) and streams events back through an asyncio queue per request
(``loop.call_soon_threadsafe``). A client that disconnects mid-stream cancels its request.
SIGTERM/SIGINT end the process at once (nothing is finished), and so does the parent's death
(``os.getppid()`` polled each second). A model that cannot be loaded exits 2 with an
``error:`` line (and a ``hint:``) in the log, before any replica-K.json is written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from homelab_dp.errors import HomelabError
from homelab_dp.infer.batcher import Batcher
from homelab_dp.infer.engine import Engine, Event, Request
from homelab_dp.infer.loading import Loaded, load_for_inference
from homelab_dp.infer.prompting import Template, eos_ids, prompt_ids, template_for
from homelab_dp.infer.request_body import BadRequest, check_length, parse_body
from homelab_dp.rundir.results import resolve_model

TOKEN_ENV = "HOMELAB_DP_REPLICA_TOKEN"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The replica's command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m homelab_dp.infer.replica")
    p.add_argument("--model", required=True, help="a run folder, model folder or adapter folder")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    p.add_argument("--id", type=int, required=True, help="this replica's number K")
    p.add_argument("--state-dir", type=Path, required=True, help="where replica-K.json goes")
    p.add_argument("--max-batch", type=int, default=None, help="default: 8 on cpu, 32 on cuda")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return p.parse_args(argv)


def write_ready_file(state_dir: Path, info: dict[str, Any]) -> Path:
    """Write ``replica-K.json`` atomically (a reader never sees half of it)."""
    path = state_dir / f"replica-{info['id']}.json"
    tmp = path.with_suffix(f".json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(info), encoding="utf-8")
    os.replace(tmp, path)
    return path


def _error(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return web.json_response(body, status=status)


def _emitter(loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> Callable[[Event], None]:
    """A callback for the generating thread that queues events in the event loop's thread."""

    def emit(event: Event) -> None:
        # A closed loop (RuntimeError) means the replica is stopping: nobody is listening.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(events.put_nowait, event)

    return emit


class Replica:
    """The HTTP side: checks requests, hands them to the batcher, streams their events."""

    def __init__(self, loaded: Loaded, template: Template, batcher: Batcher, token: str) -> None:
        self.loaded = loaded
        self.template = template
        self.batcher = batcher
        self.token = f"Bearer {token}".encode()
        self.in_flight = 0
        self.served = 0

    def app(self) -> web.Application:
        """The aiohttp application: the two endpoints behind the bearer-token check."""

        @web.middleware
        async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, self.token):
                return _error(401, "missing or wrong bearer token", "authentication_error")
            return await handler(request)

        app = web.Application(middlewares=[auth], client_max_size=8 * 1024 * 1024)
        app.router.add_get("/ready", self.ready)
        app.router.add_post("/generate", self.generate)
        return app

    async def ready(self, request: web.Request) -> web.Response:
        """``{"ok": true, "in_flight": n, "served": requests accepted so far}``."""
        return web.json_response({"ok": True, "in_flight": self.in_flight, "served": self.served})

    def _request(self, body: Any, emit: Callable[[Event], None]) -> Request:
        """The engine request for a body, or a BadRequest."""
        parsed = parse_body(body)
        tok = self.loaded.tokenizer
        if parsed.messages is not None:
            ids = prompt_ids(tok, messages=parsed.messages, template=self.template)
        else:
            ids = prompt_ids(tok, prompt=parsed.prompt)
        source = "prompt" if parsed.prompt is not None else "messages"
        max_tokens = check_length(len(ids), parsed.max_tokens, self.loaded.context, source)
        return Request(
            prompt_ids=ids,
            max_tokens=max_tokens,
            temperature=parsed.temperature,
            top_p=parsed.top_p,
            seed=parsed.seed,
            stop=tuple(parsed.stop) + self.template.stop,
            emit=emit,
        )

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """Stream one request's events as NDJSON (400 before streaming for a bad body)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[dict] = asyncio.Queue()
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "the request body is not valid JSON", "invalid_request_error")
        try:
            req = self._request(body, _emitter(loop, events))
        except BadRequest as exc:
            return web.json_response(exc.body(), status=400)
        self.in_flight += 1
        self.served += 1
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        try:
            self.batcher.submit(req)
            await response.prepare(request)
            while True:
                event = await events.get()
                await response.write(json.dumps(event).encode() + b"\n")
                if "finish_reason" in event or "error" in event:
                    break
            await response.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            req.cancelled.set()  # the client went: stop decoding its row
            print("replica: client disconnected; its request is cancelled", flush=True)
            raise
        finally:
            self.in_flight -= 1
        return response


async def _watch_parent(stop: asyncio.Event, parent: int) -> None:
    """Set ``stop`` when the parent process is gone (we were re-parented)."""
    while not stop.is_set():
        if os.getppid() != parent:
            print("replica: parent process gone; exiting", flush=True)
            stop.set()
            return
        await asyncio.sleep(1.0)


async def serve(
    args: argparse.Namespace,
    loaded: Loaded,
    template: Template,
    *,
    token: str,
    name: str,
    parent: int,
) -> None:
    """Run the server until SIGTERM/SIGINT or the death of the process ``parent``."""
    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        context=loaded.context,
        eos_ids=eos_ids(loaded.tokenizer, loaded.model),
        device=loaded.device,
    )
    warm = time.perf_counter()
    engine.generate([Request(prompt_ids(loaded.tokenizer, prompt="Hello"), 1)])
    print(f"replica {args.id}: warm-up in {time.perf_counter() - warm:.2f} s", flush=True)
    max_batch = args.max_batch or (32 if loaded.device.type == "cuda" else 8)
    batcher = Batcher(engine, max_batch)
    batcher.start()
    replica = Replica(loaded, template, batcher, token)
    runner = web.AppRunner(replica.app(), access_log=None, handle_signals=False)
    await runner.setup()
    # On stop, streams still open get half a second (aiohttp waits 60 s by default).
    site = web.TCPSite(runner, "127.0.0.1", 0, shutdown_timeout=0.5)
    await site.start()
    port = int(runner.addresses[0][1])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    info = {
        "id": args.id,
        "pid": os.getpid(),
        "port": port,
        "device": args.device,
        "model": name,
        "context": loaded.context,
        "max_batch": max_batch,
    }
    write_ready_file(args.state_dir, info)
    print(f"replica {args.id}: ready on 127.0.0.1:{port} ({name} on {args.device})", flush=True)
    watcher = asyncio.create_task(_watch_parent(stop, parent))
    await stop.wait()
    watcher.cancel()
    print(f"replica {args.id}: stopping", flush=True)
    batcher.stop(timeout=3.0)
    await runner.cleanup()


def _leave(signum: int, _frame: Any) -> None:
    print(f"replica: signal {signum} while loading; exiting", flush=True)
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    """Load, warm up, serve; 2 with an ``error:`` line when the model or arguments are bad."""
    parent = os.getppid()  # before loading: a parent that dies meanwhile is noticed too
    for sig in (signal.SIGTERM, signal.SIGINT):  # while loading: just go (the loop takes over)
        signal.signal(sig, _leave)
    args = parse_args(argv)
    token = os.environ.get(TOKEN_ENV, "")
    try:
        if not token:
            raise HomelabError(
                f"{TOKEN_ENV} is not set", hint="the serve front sets it; replicas need a secret"
            )
        if not args.state_dir.is_dir():
            raise HomelabError(f"--state-dir {args.state_dir}: no such folder")
        if args.threads:
            torch.set_num_threads(max(1, args.threads))
        ref = resolve_model(args.model)
        loaded = load_for_inference(ref, args.device)
        template = template_for(loaded.tokenizer, ref)
    except HomelabError as exc:
        print(f"error: {exc.message}", flush=True)
        if exc.hint:
            print(f"hint: {exc.hint}", flush=True)
        return 2
    print(
        f"replica {args.id}: loaded {ref.name} ({loaded.dtype}, context {loaded.context}, "
        f"template {template.kind}) on {loaded.device}",
        flush=True,
    )
    asyncio.run(serve(args, loaded, template, token=token, name=ref.name, parent=parent))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # The generating thread may still be inside a forward pass: leave without waiting for it.
    os._exit(code)
