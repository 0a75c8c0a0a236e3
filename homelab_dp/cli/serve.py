"""`homelab-dp serve`: replicas of a model behind an OpenAI-compatible HTTP API.

Every check happens before anything starts (exit 2, `error:` and `hint:`): the model resolves,
the replicas fit the devices (the serving plan), a host off loopback has an API key, the
engine is available, and the port is free — it is bound before the server starts and handed to
it, so nobody can take it in between (`app.serve`, which also reads the API key).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from homelab_dp.cli.common import EXIT_OK, number_type, print_json, print_rich
from homelab_dp.errors import HomelabError

_positive = number_type(int, lambda v: v >= 1, "a whole number", "a positive number")
_share = number_type(float, lambda v: 0 < v <= 1, "a number", "above 0 and at most 1")
_seconds = number_type(  # NaN fails the bound too
    float, lambda v: 0 < v < float("inf"), "a number", "a positive number of seconds"
)


def register(sub: Any) -> None:
    """Add `serve` to the main parser's subparsers."""
    p = sub.add_parser("serve", help="serve a model: one replica per GPU behind one HTTP API")
    p.add_argument(
        "model",
        help="a run id, a run folder (its result), a model folder or a Hugging Face id (org/name)",
    )
    p.add_argument("--replicas", default="auto", help="N, or auto (as many as fit)")
    p.add_argument("--gpus", help="cpu:N serves from N CPU processes")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free one)")
    p.add_argument(
        "--api-key",
        help="required of every request; needed to bind off loopback. Visible to every user "
        "in the process list: prefer HOMELAB_DP_API_KEY or --api-key-file",
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        help="read the API key from the first line of this file (readable by you alone)",
    )
    p.add_argument(
        "--request-timeout",
        type=_seconds,
        default=600.0,
        help="seconds a request may take before it is answered 504 (default 600)",
    )
    p.add_argument("--plan", action="store_true", help="print the serving plan and exit")
    p.add_argument("--json", action="store_true", help="with --plan: one JSON document")
    p.add_argument(
        "--context",
        type=_positive,
        help="tokens per sequence the plan budgets KV cache for (vllm: also caps each "
        "replica's max_model_len, otherwise the model's positions)",
    )
    p.add_argument(
        "--concurrent",
        type=_positive,
        default=8,
        help="sequences at once per replica the plan budgets KV cache for (default 8)",
    )
    p.add_argument(
        "--max-batch",
        type=_positive,
        help="sequences a transformers replica decodes together (8 CPU, 32 GPU); vllm "
        "ignores it (vLLM schedules its own batches)",
    )
    p.add_argument(
        "--engine",
        choices=("transformers", "vllm"),
        default="transformers",
        help="generation in the replicas (default transformers; vllm needs CUDA GPUs and vllm "
        "installed, and serves the same API)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=_share,
        help="vllm: the share of each card a replica takes (default 0.9)",
    )
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from homelab_dp.app.serve import api_key, check_listen, plan_serve, start_serving

    key = api_key(args.api_key_file, args.api_key)
    if args.json and not args.plan:
        raise HomelabError("--json goes with --plan", hint="serve MODEL --plan --json")
    check_listen(args.host, args.port, key, plan_only=args.plan)
    planned = plan_serve(
        args.model,
        gpus=args.gpus,
        replicas=args.replicas,
        context=args.context,
        concurrent=args.concurrent,
        what_if_ok=args.plan,  # what-if cards (--gpus 2x24GiB) can be planned, not served
    )
    if args.plan:
        if args.json:
            print_json(planned.plan.to_json())
        else:
            from homelab_dp.render.serve_plan import render_serve_plan

            print_rich(render_serve_plan(planned))
        return EXIT_OK
    return start_serving(
        planned,
        host=args.host,
        port=args.port,
        key=key,
        engine=args.engine,
        max_batch=args.max_batch,
        context=args.context,
        gpu_memory_utilization=args.gpu_memory_utilization,
        request_timeout=args.request_timeout,
    )
