"""A chat with one model, whoever answers: what `homelab-dp chat` and the TUI's Chat screen keep.

`ChatSession` holds the conversation (the system message, the turns so far, the sampling
settings) and asks one of two back ends for each answer:

- in process (`app.chat.InProcess`, opened by `open_in_process`): the model loaded in this
  process, for `homelab-dp chat`; a conversation longer than the context loses its oldest turns;
- a local server (`app.chat_server.LocalServer`): a background `serve` of the model on loopback,
  for the TUI, which never loads torch nor initialises CUDA.

A turn that fails (a message too long, a server that died) is not kept: the next message is sent
without it. This module loads no torch: the in-process back end is imported once a model is
really loaded, so that a bad MODEL is an ``error:`` within the CLI's start-up time.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from homelab_dp.errors import HomelabError
from homelab_dp.probe.nvml import probe
from homelab_dp.probe.visible_gpus import ORDER_ENV, cuda_device_env
from homelab_dp.runs.folder.run_folder import read_run_spec
from homelab_dp.runs.model_ref import ModelRef, resolve_model_arg


class ChatSession:
    """One conversation and the back end that answers it."""

    def __init__(
        self,
        backend: Any = None,
        *,
        system: str = "",
        temperature: float = 0.7,
        max_tokens: int = 256,
    ) -> None:
        """``backend``: `app.chat.InProcess` (for `ask`) or `app.chat_server.LocalServer`
        (for `stream`); it may be set later, and changed between answers."""
        self.backend = backend
        self.system = system
        """The system message ("" for none)."""
        self.temperature = temperature
        """0: greedy."""
        self.max_tokens = max_tokens
        """Most tokens per answer."""
        self.turns: list[dict[str, str]] = []
        """User and assistant messages so far (without the system message)."""

    def reset(self) -> None:
        """Forget the turns (the system message and settings stay)."""
        self.turns.clear()

    def messages(self) -> list[dict[str, str]]:
        """The conversation as a chat template (or the chat API) takes it."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def ask(self, text: str, on_text: Callable[[str], None]) -> str:
        """Answer ``text`` in process, its text streamed to ``on_text``; the finish reason
        ("stop" or "length"). Raises HomelabError (the turn is then forgotten)."""
        self.turns.append({"role": "user", "content": text})
        try:
            result = self.backend.answer(self, on_text)
        except HomelabError:
            self.turns.pop()
            raise
        self.turns.append({"role": "assistant", "content": result.text})
        return result.finish_reason

    async def stream(self, text: str) -> AsyncIterator[str]:
        """Answer ``text`` through a server: its text pieces as they come. Whatever the back end
        raises (`app.chat_server.ServerFailed`) passes through, the turn forgotten."""
        self.turns.append({"role": "user", "content": text})
        answer = ""
        try:
            async for piece in self.backend.stream(
                self.messages(), temperature=self.temperature, max_tokens=self.max_tokens
            ):
                answer += piece
                yield piece
        except BaseException:
            self.turns.pop()
            raise
        self.turns.append({"role": "assistant", "content": answer})


def check_settings(temperature: float, max_tokens: int) -> None:
    """`chat`'s sampling options. Raises HomelabError."""
    if temperature < 0:
        raise HomelabError("--temperature must be >= 0", hint="0 is greedy; 0.7 is a usual value")
    if max_tokens < 1:
        raise HomelabError("--max-tokens must be at least 1", hint="e.g. --max-tokens 256")


def chat_device(gpus: str | None, device: str | None) -> str | None:
    """The device ``--gpus`` or ``--device`` name, or None for the default. Raises HomelabError."""
    if gpus is not None:
        wanted = gpus.strip().lower()
        if wanted == "cpu":
            return "cpu"
        if not wanted.isdigit():
            raise HomelabError(
                f"--gpus {gpus!r}: chat runs on one device", hint="use --gpus cpu or --gpus 0"
            )
        return f"cuda:{wanted}"
    return device


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


def open_in_process(
    model: str,
    *,
    gpus: str | None = None,
    device: str | None = None,
    temperature: float = 0.7,
    max_tokens: int = 256,
    system: str = "",
    on_loading: Callable[[str], None] = lambda name: None,
) -> ChatSession:
    """Load MODEL in this process and open a chat with it (`homelab-dp chat`).

    The options are checked and MODEL resolved before torch is imported (a bad one is an
    ``error:`` at once); this process's CUDA environment is set for ``gpus``/``device`` before
    CUDA starts (it reads it once); ``on_loading`` hears the model's name as loading begins.
    Raises HomelabError."""
    check_settings(temperature, max_tokens)
    wanted = chat_device(gpus, device)
    ref = resolve_model_arg(model)
    env, where = device_env(os.environ, gpus, device)
    os.environ.update(env)
    on_loading(ref.name)
    from homelab_dp.app.chat import InProcess  # torch: only once a model is really loaded

    backend = InProcess.load(ref, where or wanted)
    return ChatSession(backend, system=system, temperature=temperature, max_tokens=max_tokens)


def base_model(ref: ModelRef) -> Path:
    """What a result is compared with: an adapter's base, else the run's preset model."""
    if ref.base is not None:
        return ref.base
    if ref.run_dir is not None:
        return Path(read_run_spec(ref.run_dir).preset.model.path)
    raise HomelabError(
        f"{ref.name}: a model folder has no base model to compare with",
        hint="choose a run's result to compare it with the model it was trained from",
    )


def chat_targets(model: str, root: Path, *, compare: bool) -> list[tuple[str, str]]:
    """What the TUI serves for MODEL: (title, folder) of the model, then of its base when
    ``compare``. A Hugging Face id must be in the cache (the TUI downloads no model); the
    server gets folders, not a run id (it may look for runs somewhere else).
    Raises HomelabError."""
    ref = resolve_model_arg(model, root, fetch=False)
    targets = [(ref.name, str(ref.run_dir or ref.path))]
    if compare:
        base = base_model(ref)
        targets.append((f"base: {base.name}", str(base)))
    return targets


def server_cards() -> list[str]:
    """The GPUs a chat server may use (UUID or index), none on a machine without them."""
    return [g.uuid or str(g.index) for g in probe().gpus]
