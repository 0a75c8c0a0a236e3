"""The body of a replica's ``POST /generate``, checked before anything is generated.

Every problem is a `BadRequest` naming the field (``param``), which the replica answers with
HTTP 400 and an OpenAI-style error body. Fields not in the protocol are ignored (the front may
pass more than the replica uses); a known field of the wrong type is an error.

Defaults for absent (or null) fields: ``max_tokens`` up to the context, ``temperature`` 1.0
and ``top_p`` 1.0 (the OpenAI API's defaults), no ``stop`` strings, a random ``seed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant")


class BadRequest(Exception):
    """A request the replica refuses before generating (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        """The protocol's error body."""
        return {
            "error": {
                "message": self.message,
                "type": "invalid_request_error",
                "param": self.param,
                "code": None,
            }
        }


@dataclass(frozen=True)
class GenerateBody:
    """A checked /generate request (the prompt not yet tokenized)."""

    prompt: str | None
    """A raw prompt, or None when ``messages`` is given."""
    messages: list[dict[str, str]] | None
    """A conversation to render with the model's template, or None."""
    max_tokens: int | None
    """Most tokens to generate; None: up to the context."""
    temperature: float
    """0: greedy."""
    top_p: float
    """Nucleus sampling mass in [0, 1] (0 keeps only the most likely token)."""
    stop: tuple[str, ...]
    """Strings that end the answer (empty strings dropped)."""
    seed: int | None
    """Seed of this request's sampler."""


def _number(body: dict, key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"{key} must be a number", key)
    return float(value)


def _integer(body: dict, key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be an integer", key)
    return value


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}", "messages")
        if not isinstance(m.get("content"), str):
            raise BadRequest(f"messages[{i}].content must be a string", "messages")
        out.append({"role": m["role"], "content": m["content"]})
    if all(m["role"] == "system" for m in out):
        raise BadRequest("messages needs at least one user or assistant message", "messages")
    return out


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise BadRequest("stop must be a string or a list of strings", "stop")
    return tuple(s for s in value if s)


def parse_body(body: Any) -> GenerateBody:
    """Check a decoded JSON body; raises `BadRequest` naming the first bad field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise BadRequest("give exactly one of prompt and messages", "prompt")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string", "prompt")
        if not prompt:
            raise BadRequest("prompt is empty", "prompt")
    else:
        messages = _messages(messages)
    max_tokens = _integer(body, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest("max_tokens must be at least 1", "max_tokens")
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise BadRequest("temperature must be >= 0 (0 = greedy)", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 <= top_p <= 1:
        raise BadRequest("top_p must be between 0 and 1", "top_p")
    return GenerateBody(
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        stop=_stop(body.get("stop")),
        seed=_integer(body, "seed"),
    )


def check_length(prompt_tokens: int, max_tokens: int | None, context: int, source: str) -> int:
    """The max_tokens to use, or `BadRequest` when the prompt and answer exceed the context.

    ``source`` names the prompt's field (``prompt`` or ``messages``) for a prompt too long alone.
    """
    if prompt_tokens >= context:
        raise BadRequest(
            f"the prompt has {prompt_tokens} tokens; the model's context is {context}", source
        )
    if max_tokens is None:
        return context - prompt_tokens
    if prompt_tokens + max_tokens > context:
        raise BadRequest(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context of {context} tokens",
            "max_tokens",
        )
    return max_tokens
