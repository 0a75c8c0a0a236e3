"""`homelab-dp serve`: replicas of a model behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
from typing import Any

from homelab_dp.errors import HomelabError


def register(sub: Any) -> None:
    """Add `serve` to the main parser's subparsers."""
    p = sub.add_parser("serve", help="serve a model: one replica per GPU behind one HTTP API")
    p.add_argument("model", help="a run id, a run folder (its result) or a model folder")
    p.add_argument("--replicas", default="auto", help="N, or auto (as many as fit)")
    p.add_argument("--gpus", help="cpu:N serves from N CPU processes")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", help="required of every request; needed to bind off loopback")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    raise HomelabError("serve is being built", hint="see issue 13")
