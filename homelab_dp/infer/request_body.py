"""The body of a replica's ``POST /generate``, checked before anything is generated.

Every problem is a `BadRequest` naming the field (``param``), which the replica answers with
HTTP 400 and an OpenAI-style error body. Fields not in the protocol are ignored (the front may
pass more than the replica uses); a known field of the wrong type is an error.

Defaults for absent (or null) fields: ``max_tokens`` up to the context, ``temperature`` 1.0
and ``top_p`` 1.0 (the OpenAI API's defaults), no ``stop`` strings, a random ``seed``.

The bounds are the front's (`homelab_dp.serve.openai_api`, which the replica cannot import):
nothing accepted here can fail in generation. A temperature between 0 and `MIN_TEMPERATURE`
(float32 logits / T overflow), a seed outside `SEED_RANGE` (``torch.Generator`` raises), a stop
string over `MAX_STOP_CHARS`, a string that is not valid Unicode (a lone surrogate) and a prompt
longer than the context can hold by its size alone (`check_size`, before tokenizing) are 400s;
`decode_json` refuses NaN/Infinity and nesting that exhausts the parser's recursion.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant")
MIN_TEMPERATURE = 1e-5
"""The smallest temperature above 0 (float32 logits / T stay finite)."""
SEED_RANGE = (-(2**63), 2**64 - 1)
"""The seeds ``torch.Generator.manual_seed`` takes."""
MAX_STOP_CHARS = 256
"""The longest stop string."""
PROMPT_CHARS_PER_TOKEN = 32
"""More characters than this per token of the context cannot fit it: refused untokenized."""
PROMPT_BYTES_PER_TOKEN = 64
"""Likewise in UTF-8 bytes."""


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


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def decode_json(raw: bytes) -> Any:
    """A request body as strict JSON (no NaN/Infinity); `BadRequest` for anything else,
    nesting deep enough to exhaust the parser's recursion included."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON ({exc})") from None
    except RecursionError:
        raise BadRequest("the request body is not valid JSON (nested too deeply)") from None


def _text(value: str, key: str) -> str:
    """``value``, if it is valid Unicode (a lone surrogate cannot be tokenized)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{key} is not valid Unicode (a lone surrogate)", key) from None
    return value


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
        out.append({"role": m["role"], "content": _text(m["content"], "messages")})
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
    if any(len(s) > MAX_STOP_CHARS for s in value):
        raise BadRequest(f"stop strings must be at most {MAX_STOP_CHARS} characters", "stop")
    return tuple(_text(s, "stop") for s in value if s)


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
        _text(prompt, "prompt")
    else:
        messages = _messages(messages)
    max_tokens = _integer(body, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest("max_tokens must be at least 1", "max_tokens")
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
        raise BadRequest(
            f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}", "temperature"
        )
    top_p = _number(body, "top_p", 1.0)
    if not 0 <= top_p <= 1:
        raise BadRequest("top_p must be between 0 and 1", "top_p")
    seed = _integer(body, "seed")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise BadRequest(f"seed must be within {SEED_RANGE[0]}..{SEED_RANGE[1]}", "seed")
    return GenerateBody(
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        stop=_stop(body.get("stop")),
        seed=seed,
    )


def check_size(body: GenerateBody, context: int) -> None:
    """`BadRequest` for a prompt too large for ``context`` tokens by its size alone (characters
    or UTF-8 bytes), so that no tokenizer spends seconds on it."""
    texts = (
        [body.prompt] if body.prompt is not None else [m["content"] for m in body.messages or []]
    )
    source = "prompt" if body.prompt is not None else "messages"
    chars = sum(len(t) for t in texts)
    if chars > PROMPT_CHARS_PER_TOKEN * context:
        raise BadRequest(
            f"the {source} has {chars} characters: more than fit the model's context of "
            f"{context} tokens",
            source,
        )
    size = sum(len(t.encode("utf-8")) for t in texts)
    if size > PROMPT_BYTES_PER_TOKEN * context:
        raise BadRequest(
            f"the {source} has {size} bytes: more than fit the model's context of {context} tokens",
            source,
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
