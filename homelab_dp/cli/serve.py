"""`homelab-dp serve`: replicas of a model behind an OpenAI-compatible HTTP API.

Every check happens before anything starts (exit 2, `error:` and `hint:`): the model resolves,
the replicas fit the devices (the serving plan), a host off loopback has an API key, the
engine is available, and the port is free — it is bound here and handed to the server, so
nobody can take it in between.

The API key: ``--api-key-file PATH`` (its first line; a file other users can read is
refused) or ``$HOMELAB_DP_API_KEY``; ``--api-key KEY`` still works but is visible to every user
in the process list, so it draws a warning on stderr. The key never reaches the replicas.
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import os
import socket
import stat
import sys
from pathlib import Path
from typing import Any

from homelab_dp.cli.common import EXIT_OK, print_json, print_rich
from homelab_dp.errors import HomelabError

KEY_ENV = "HOMELAB_DP_API_KEY"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not above 0 and at most 1")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):  # NaN fails this too
        raise argparse.ArgumentTypeError(f"{value} is not a positive number of seconds")
    return value


def read_key_file(path: Path) -> str:
    """The API key in ``path`` (its first line), or an error when the file is missing, empty,
    or readable or writable by other users."""
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise HomelabError(
            f"--api-key-file {path}: no such file",
            hint="write the key on the file's first line (chmod 600 it)",
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HomelabError(
            f"--api-key-file {path}: cannot be read ({exc})", hint="a text file, chmod 600"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise HomelabError(
            f"--api-key-file {path}: other users can read or write it "
            f"(mode {stat.S_IMODE(mode):o})",
            hint=f"chmod 600 {path}",
        )
    lines = text.splitlines()
    key = lines[0].strip() if lines else ""
    if not key:
        raise HomelabError(
            f"--api-key-file {path}: the first line is empty", hint="write the key on it"
        )
    return key


def api_key(args: argparse.Namespace) -> str | None:
    """The API key: --api-key-file, --api-key (with a warning) or $HOMELAB_DP_API_KEY."""
    if args.api_key_file is not None and args.api_key:
        raise HomelabError(
            "--api-key and --api-key-file both give the key", hint="keep --api-key-file"
        )
    if args.api_key_file is not None:
        return read_key_file(args.api_key_file)
    if args.api_key:
        sys.stderr.write(
            "warning: --api-key is visible to every user of this machine in the process list\n"
            f"hint: set {KEY_ENV} or use --api-key-file PATH (chmod 600) instead\n"
        )
        return str(args.api_key)
    return os.environ.get(KEY_ENV) or None


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
        help=f"required of every request; needed to bind off loopback. Visible to every user "
        f"in the process list: prefer {KEY_ENV} or --api-key-file",
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


def is_loopback(host: str) -> bool:
    """Whether ``host`` is only reachable from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, or the error of a taken port / unknown host."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise HomelabError(
            f"--host {host}: not an address of this machine ({exc.strerror})",
            hint="use 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)",
        ) from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT, not a live listener
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise HomelabError(
            f"--port {port}: cannot listen on {host}:{port} ({exc.strerror})",
            hint="another program holds that port: pick another with --port, or stop it",
        ) from None
    return sock


def check_engine(engine: str, devices: list[str]) -> None:
    """vLLM replicas need vllm importable and CUDA cards; transformers runs anywhere."""
    if engine == "transformers":
        return
    if importlib.util.find_spec("vllm") is None:
        raise HomelabError(
            "--engine vllm: vllm is not installed",
            hint="`pip install vllm` on a machine with NVIDIA GPUs, or drop --engine "
            "(transformers replicas work everywhere)",
        )
    if not any(d.startswith("cuda") for d in devices):
        raise HomelabError(
            "--engine vllm: vLLM replicas need CUDA GPUs, and these replicas run on the CPU",
            hint="drop --engine (transformers replicas run on the CPU)",
        )


def cmd_serve(args: argparse.Namespace) -> int:
    from homelab_dp.app.serve import plan_serve
    from homelab_dp.serving.front.openai_server import serve
    from homelab_dp.serving.front.replica_supervisor import ReplicaLaunch

    args.api_key = api_key(args)
    if args.json and not args.plan:
        raise HomelabError("--json goes with --plan", hint="serve MODEL --plan --json")
    if not args.plan and not is_loopback(args.host) and not args.api_key:
        raise HomelabError(
            f"--host {args.host} is reachable from other machines and there is no --api-key",
            hint="add --api-key SECRET (clients send `Authorization: Bearer SECRET`), "
            "or bind 127.0.0.1",
        )
    if not 0 <= args.port <= 65535:
        raise HomelabError(f"--port {args.port}: not a port", hint="a number from 1 to 65535")
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
    check_engine(args.engine, [r.device for r in planned.replicas])
    if args.gpu_memory_utilization is not None and args.engine != "vllm":
        raise HomelabError(
            "--gpu-memory-utilization is for vLLM replicas",
            hint="add --engine vllm, or drop --gpu-memory-utilization",
        )
    sock = bind(args.host, args.port)
    ref = planned.ref
    model = (ref.run_dir or ref.path).absolute()
    launches = [
        ReplicaLaunch(r.device, r.label, r.cuda_visible, r.threads) for r in planned.replicas
    ]
    return serve(
        str(model),
        ref.name,
        launches,
        host=args.host,
        port=sock.getsockname()[1],
        api_key=args.api_key,
        max_batch=args.max_batch,
        sock=sock,
        engine=args.engine,
        context=args.context,
        gpu_memory_utilization=args.gpu_memory_utilization,
        request_timeout=args.request_timeout,
    )
