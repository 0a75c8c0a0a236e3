"""`homelab-dp chat`: talk to a model in the terminal, tokens streamed as they come."""

from __future__ import annotations

import argparse
from typing import Any

from homelab_dp.errors import HomelabError


def register(sub: Any) -> None:
    """Add `chat` to the main parser's subparsers."""
    p = sub.add_parser("chat", help="chat with a model in the terminal")
    p.add_argument("model", help="a run id, a run folder (its result) or a model folder")
    p.set_defaults(func=cmd_chat)


def cmd_chat(args: argparse.Namespace) -> int:
    raise HomelabError("chat is being built", hint="see issue 13")
