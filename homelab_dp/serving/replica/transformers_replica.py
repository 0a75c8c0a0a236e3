"""A replica: one copy of the model behind a small HTTP server on loopback (the serve front's unit).

    python -m homelab_dp.serving.replica.transformers_replica --model MODEL --device DEVICE --id K --state-dir DIR
        [--max-batch B] [--threads T]            (env HOMELAB_DP_REPLICA_TOKEN=<secret>)

The protocol between the serve front and its replicas: it loads MODEL on DEVICE, runs a 1-token warm-up,
binds 127.0.0.1 on an ephemeral port and writes ``DIR/replica-K.json`` atomically; then

- ``GET /ready`` -> ``{"ok": true, "in_flight": n, "served": requests accepted so far}``;
- ``POST /generate`` -> an NDJSON stream of ``{"text": delta}`` lines and one last
  ``{"finish_reason", "usage"}`` line (or, when the generation itself fails, an
  ``{"error": {"message", "type": "server_error", ...}}`` line); a bad body is HTTP 400 with
  ``param`` (`request_body`);
- every request needs ``Authorization: Bearer <token>`` (else 401).

The HTTP side, the ready file, the signals and the parent watch are `http_replica`'s (shared
with the vLLM replica, `vllm_replica`). Here: the model loads with transformers, and generation
runs in one thread (`Batcher`) that streams events back through an asyncio queue per request
(``loop.call_soon_threadsafe``). A client that disconnects mid-stream cancels its request.
SIGTERM/SIGINT end the process at once (nothing is finished), and so does the front's death
at any moment (`http_replica.watch_parent`: the kernel's death signal and a poll of the parent
pid; an orphan removes its files). A model that cannot be loaded exits 2 with an
``error:`` line (and a ``hint:``) in the log, before any replica-K.json is written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import torch

from homelab_dp.errors import HomelabError
from homelab_dp.runs.model_ref import resolve_model
from homelab_dp.serving.replica.generation_engine import Batcher, Engine, Event, Request
from homelab_dp.serving.replica.prompt_templates import Template, eos_ids, prompt_ids, template_for
from homelab_dp.serving.replica.replica_protocol import (
    Prepared,
    ReplicaServer,
    base_parser,
    check_setup,
    exit_now,
    is_last,
    leave_while_loading,
    report,
    run_until_stopped,
)
from homelab_dp.serving.replica.result_model import Loaded, load_for_inference


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The replica's command line (see the module docstring)."""
    p = base_parser("python -m homelab_dp.serving.replica.transformers_replica")
    p.add_argument("--max-batch", type=int, default=None, help="default: 8 on cpu, 32 on cuda")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return p.parse_args(argv)


def _emitter(loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> Callable[[Event], None]:
    """A callback for the generating thread that queues events in the event loop's thread."""

    def emit(event: Event) -> None:
        # A closed loop (RuntimeError) means the replica is stopping: nobody is listening.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(events.put_nowait, event)

    return emit


class Replica(ReplicaServer):
    """Requests go to the batcher; their events come back through a queue each."""

    def __init__(self, loaded: Loaded, template: Template, batcher: Batcher, token: str) -> None:
        super().__init__(token, loaded.tokenizer, template, loaded.context)
        self.loaded = loaded
        self.batcher = batcher

    async def events(self, prepared: Prepared) -> AsyncIterator[Event]:
        """Submit the request to the batcher and yield its events as they come."""
        queue: asyncio.Queue[Event] = asyncio.Queue()
        body = prepared.body
        req = Request(
            prompt_ids=prepared.prompt_ids,
            max_tokens=prepared.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=prepared.stop,
            emit=_emitter(asyncio.get_running_loop(), queue),
        )
        self.batcher.submit(req)
        done = False
        try:
            while not done:
                event = await queue.get()
                done = is_last(event)
                yield event
        finally:
            if not done:
                req.cancelled.set()  # the client went: stop decoding its row


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
    info = {"model": name, "context": loaded.context, "max_batch": max_batch}
    await run_until_stopped(
        replica, args, info, parent=parent, on_stop=lambda: batcher.stop(timeout=3.0)
    )


def main(argv: list[str] | None = None) -> int:
    """Load, warm up, serve; 2 with an ``error:`` line when the model or arguments are bad."""
    parent = leave_while_loading()
    args = parse_args(argv)
    try:
        token = check_setup(args)
        if args.threads:
            torch.set_num_threads(max(1, args.threads))
        ref = resolve_model(args.model)
        loaded = load_for_inference(ref, args.device)
        template = template_for(loaded.tokenizer, ref)
    except HomelabError as exc:
        return report(exc)
    print(
        f"replica {args.id}: loaded {ref.name} ({loaded.dtype}, context {loaded.context}, "
        f"template {template.kind}) on {loaded.device}",
        flush=True,
    )
    asyncio.run(serve(args, loaded, template, token=token, name=ref.name, parent=parent))
    return 0


if __name__ == "__main__":
    exit_now(main())
