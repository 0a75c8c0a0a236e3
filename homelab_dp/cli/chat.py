"""`homelab-dp chat`: talk to a model in the terminal, tokens streamed as they come.

The model loads in this process (`serving.replica.result_model`; a MODEL that names nothing is an ``error:``
before torch is imported). Each line read from stdin (a terminal or a pipe) is a message, or
one of the commands of `HELP`; EOF, ``/quit`` and Ctrl-C end the chat with exit 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any

from homelab_dp.errors import HomelabError
from homelab_dp.probe.visible_gpus import ORDER_ENV, cuda_device_env

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


def _device(args: argparse.Namespace) -> str | None:
    """The device the arguments name, or None for the default."""
    if args.gpus is not None:
        gpus = args.gpus.strip().lower()
        if gpus == "cpu":
            return "cpu"
        if not gpus.isdigit():
            raise HomelabError(
                f"--gpus {args.gpus!r}: chat runs on one device", hint="use --gpus cpu or --gpus 0"
            )
        return f"cuda:{gpus}"
    return args.device


def device_env(
    env: Mapping[str, str], gpus: str | None, device: str | None = None
) -> tuple[dict[str, str], str | None]:
    """The environment this process loads the model in, and the device to load it on.

    ``gpus`` is what ``--gpus`` asked for: ``cpu`` hides every card (no CUDA context at all), a
    GPU's NVML index leaves that card alone as ``cuda:0``, counted in PCI bus order as NVML
    and `homelab-dp probe` count (the launcher's one rule, `probe.visible_gpus.cuda_device_env`);
    None (``--device`` or nothing) keeps ``env``'s own cards, in PCI bus order where
    ``CUDA_VISIBLE_DEVICES`` names some. ``device`` (``--device cuda:N``) without
    ``CUDA_VISIBLE_DEVICES``: every card stays visible, in PCI bus order too, so that ``cuda:N``
    is card N of ``homelab-dp probe`` (CUDA's own default counts the fastest card first).
    """
    if gpus is None:
        out = cuda_device_env(env, None)
        if device is not None and device.strip().lower().startswith("cuda"):
            out[ORDER_ENV] = "PCI_BUS_ID"
        return out, None
    gpus = gpus.strip().lower()
    if gpus == "cpu":
        return cuda_device_env(env, []), "cpu"
    return cuda_device_env(env, [gpus]), "cuda:0"


def _check(args: argparse.Namespace) -> None:
    if args.temperature < 0:
        raise HomelabError("--temperature must be >= 0", hint="0 is greedy; 0.7 is a usual value")
    if args.max_tokens < 1:
        raise HomelabError("--max-tokens must be at least 1", hint="e.g. --max-tokens 256")


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
            result = chat.ask(line, show)
        except HomelabError as exc:
            print(f"error: {exc.message}\nhint: {exc.hint}")
            continue
        show("\n" if result.finish_reason != "length" else " […]\n")


def cmd_chat(args: argparse.Namespace) -> int:
    """Load MODEL and chat on stdin/stdout until EOF, /quit or Ctrl-C."""
    from homelab_dp.runs.model_ref import resolve_model_arg

    _check(args)
    device = _device(args)
    ref = resolve_model_arg(args.model)  # a bad MODEL stops here, before torch is imported
    env, where = device_env(os.environ, args.gpus, args.device)
    os.environ.update(env)  # before CUDA starts in this process: it reads them once
    device = where or device
    sys.stderr.write(f"loading {ref.name} …\n")
    from homelab_dp.app.chat import Conversation
    from homelab_dp.serving.replica.prompt_templates import template_for
    from homelab_dp.serving.replica.result_model import default_device, load_for_inference

    loaded = load_for_inference(ref, device or default_device())
    template = template_for(loaded.tokenizer, ref)
    chat = Conversation(
        loaded,
        template,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        system=args.system,
    )
    sys.stderr.write(
        f"chatting with {ref.name} on {loaded.device} ({template.kind} template, context "
        f"{loaded.context}); /help for commands, /quit or Ctrl-D to leave\n"
    )
    try:
        _loop(chat)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
    return 0
