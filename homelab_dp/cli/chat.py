"""`homelab-dp chat`: talk to a model in the terminal, tokens streamed as they come.

The model loads in this process (`app.chat_session.open_in_process`; a MODEL that names nothing
is an ``error:`` before torch is imported). Each line read from stdin (a terminal or a pipe) is a message, or
one of the commands of `HELP`; EOF, ``/quit`` and Ctrl-C end the chat with exit 0.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from homelab_dp.errors import HomelabError

HELP = """commands:
  /reset           forget the conversation (the system message stays)
  /system TEXT     set the system message (/system alone removes it)
  /temperature X   sampling temperature (0 = greedy)
  /max_tokens N    most tokens per answer
  /help            this list
  /quit            leave (so do Ctrl-D and Ctrl-C)"""


def register(sub: Any) -> None:
    """Add `chat` to the main parser's subparsers."""
    p = sub.add_parser("chat", help="chat with a model in the terminal")
    p.add_argument(
        "model",
        help="a run id, a run folder (its result), a model folder or a Hugging Face id (org/name)",
    )
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer")
    p.add_argument("--system", default="", help="a system message")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--gpus", help="cpu, or the index of the GPU to load it on")
    where.add_argument("--device", help="cpu or cuda:N (default: cuda:0 if there is one)")
    p.set_defaults(func=cmd_chat)


def _command(chat: Any, line: str) -> bool:
    """Apply a /command; False when the chat should end."""
    name, _, rest = line.partition(" ")
    rest = rest.strip()
    if name in ("/quit", "/exit"):
        return False
    if name == "/help":
        print(HELP)
    elif name == "/reset":
        chat.reset()
        print("(conversation reset)")
    elif name == "/system":
        chat.system = rest
        print(f"(system message {'set' if rest else 'removed'})")
    elif name in ("/temperature", "/max_tokens"):
        try:
            value = float(rest) if name == "/temperature" else int(rest)
        except ValueError:
            value = -1
        if value < (0 if name == "/temperature" else 1):
            print(
                f"({name} needs a {'number >= 0' if name == '/temperature' else 'whole number >= 1'})"
            )
        elif name == "/temperature":
            chat.temperature = float(value)
            print(f"(temperature {value:g})")
        else:
            chat.max_tokens = int(value)
            print(f"(max_tokens {value})")
    else:
        print(f"(unknown command {name}; /help lists them)")
    return True


def _loop(chat: Any) -> None:
    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    while True:
        show("> ")
        line = sys.stdin.readline()
        if not line:  # EOF
            show("\n")
            return
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if not _command(chat, line):
                return
            continue
        try:
            reason = chat.ask(line, show)
        except HomelabError as exc:
            print(f"error: {exc.message}\nhint: {exc.hint}")
            continue
        show("\n" if reason != "length" else " […]\n")


def cmd_chat(args: argparse.Namespace) -> int:
    """Load MODEL and chat on stdin/stdout until EOF, /quit or Ctrl-C."""
    from homelab_dp.app.chat_session import open_in_process

    chat = open_in_process(
        args.model,
        gpus=args.gpus,
        device=args.device,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        system=args.system,
        on_loading=lambda name: sys.stderr.write(f"loading {name} …\n"),
    )
    sys.stderr.write(
        f"chatting with {chat.backend.describe()}; /help for commands, /quit or Ctrl-D to leave\n"
    )
    try:
        _loop(chat)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
    return 0
