"""The OpenAI-compatible surface, as pure functions: request validation and response shapes.

Requests: ``POST /v1/completions`` and ``POST /v1/chat/completions`` are checked here and turned
into one `Generation` (what the replica's ``/generate`` takes). Every knob is checked against
what the engine can do, so that no accepted request can fail in generation (and take its batch
down): a field of the wrong type, a missing required field, ``n`` other than 1, a temperature
outside [0, 2] or between 0 and `MIN_TEMPERATURE` (logits / T overflow float32), a seed
``torch.Generator`` cannot take (`SEED_RANGE`), ``max_tokens`` < 1, a string that is not valid
Unicode (a lone surrogate), a stop string longer than `MAX_STOP_CHARS`, or a knob OpenAI has and
we do not honour set to anything but its default (``presence_penalty``, ``frequency_penalty``,
``logit_bias``, ``logprobs``), or an answer shape other than free text (``response_format``
JSON, ``tool_choice`` required or named, ``function_call``, ``modalities``/``audio``:
`_output_shape`) raise `ApiError` (HTTP 400 with OpenAI's error body, ``param`` naming the
field). The body must be strict JSON: no ``NaN``/``Infinity``, no nesting deep
enough to exhaust the parser's recursion. A prompt longer than `PROMPT_CHARS_PER_TOKEN` characters
or `PROMPT_BYTES_PER_TOKEN` UTF-8 bytes per token of the context is refused before any tokenizer
sees it (`check_prompt_size`). The limits are `planning.serve_plan`'s, which the replica checks too. Other fields we do not know are ignored: OpenAI clients send many
(``user``, ``stream_options``, ...).

Responses: ``text_completion`` / ``chat.completion`` objects, their streamed chunks, and
server-sent events (``data: {...}\\n\\n`` ending with ``data: [DONE]\\n\\n``).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from homelab_dp import json_safe
from homelab_dp.planning.serve_plan import (
    MAX_STOP_CHARS,
    MIN_TEMPERATURE,
    SEED_RANGE,
    request_size_problem,
)

Kind = Literal["completion", "chat"]
ROLES = ("system", "user", "assistant")
SSE_DONE = b"data: [DONE]\n\n"
MAX_TOKENS_LIMIT = 2**31 - 1
"""The largest max_tokens taken at all (the context bounds it further once a replica told it)."""
UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": {},
    "logprobs": False,
    "top_logprobs": 0,
    "best_of": 1,
    "echo": False,
    "suffix": "",
}
"""OpenAI knobs this server does not implement: each passes at its default (what clients send
unasked), and any other value is a 400 rather than silently ignored."""


class ApiError(Exception):
    """A request the API refuses: its HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI sends with an error."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``: OpenAI's error shape."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True)
class Generation:
    """One validated request: what to generate and how the answer is shaped."""

    kind: Kind
    """completion (``prompt``) or chat (``messages``)."""
    model: str | None
    """The model the client named (None: whichever is served)."""
    prompt: str | None = None
    """The text to continue (completions)."""
    messages: list[dict[str, str]] | None = None
    """The conversation, ``{"role", "content"}`` with string content (chat)."""
    max_tokens: int | None = None
    """Tokens to generate at most (None: up to the context)."""
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    stop: list[str] = field(default_factory=list)
    """Strings that end the answer (not included in it)."""
    stream: bool = False
    """Answer as server-sent events."""
    seed: int | None = None
    """Sampling seed (the same seed and request give the same answer)."""

    def replica_body(self) -> dict[str, Any]:
        """The body of the replica's ``POST /generate`` (the replica protocol)."""
        return {
            "prompt": self.prompt,
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": list(self.stop),
            "seed": self.seed,
        }


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or ApiError (400): strict JSON (no NaN/Infinity), and
    nesting deep enough to exhaust the parser's recursion is a 400 too, not a crash."""
    try:
        doc = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(f"the request body is not valid JSON ({exc})") from None
    except RecursionError:
        raise ApiError("the request body is not valid JSON (nested too deeply)") from None
    if not isinstance(doc, dict):
        raise ApiError("the request body must be a JSON object")
    return doc


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _int(
    doc: dict[str, Any], name: str, *, minimum: int | None = None, maximum: int | None = None
) -> int | None:
    """An optional integer field (bool is not an integer here, whatever Python says)."""
    value = doc.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"{name} must be an integer, not {_type_name(value)}", param=name)
    if minimum is not None and value < minimum:
        raise ApiError(f"{name} must be at least {minimum}, got {value}", param=name)
    if maximum is not None and value > maximum:
        raise ApiError(f"{name} must be at most {maximum}, got {value}", param=name)
    return value


def _text(value: str, where: str) -> str:
    """``value`` if it is valid Unicode (a lone surrogate, which JSON's ``\\ud800`` escape can
    carry, cannot be encoded, tokenized or sent on)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            f"{where} is not valid Unicode (a lone surrogate such as \\ud800)", param=where
        ) from None
    return value


def _number(doc: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    """An optional number field within [low, high]."""
    value = doc.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(f"{name} must be a number, not {_type_name(value)}", param=name)
    if not low <= value <= high:  # NaN fails this too
        raise ApiError(f"{name} must be between {low:g} and {high:g}, got {value}", param=name)
    return float(value)


def _temperature(doc: dict[str, Any]) -> float:
    value = _number(doc, "temperature", 1.0, 0.0, 2.0)
    if 0 < value < MIN_TEMPERATURE:
        raise ApiError(
            f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {value:g}",
            param="temperature",
        )
    return value


def _unsupported(doc: dict[str, Any]) -> None:
    """OpenAI knobs we do not implement: their defaults pass, anything else is a 400."""
    for name, default in UNSUPPORTED_DEFAULTS.items():
        value = doc.get(name)
        if value is None or value == default:  # (NaN equals nothing)
            continue
        raise ApiError(
            f"{name} is not supported by this server (only its default, {default!r})",
            param=name,
        )


TOOL_CHOICES = ("none", "auto")
"""``tool_choice`` values a free-text answer honours: no tool, or the model's own choice."""


def _output_shape(doc: dict[str, Any]) -> None:
    """Knobs that ask for an answer shape other than free text — JSON (``response_format``),
    a tool call (``tool_choice`` ``required`` or a named function, the older
    ``function_call``), audio (``modalities``, ``audio``) — are 400 naming the field: the
    server generates free text only, and a 200 with free text would break the client later.
    ``tools`` with ``tool_choice`` ``auto`` or ``none`` pass: free text is an answer to them."""
    fmt = doc.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind != "text":
            shown = repr(kind) if isinstance(kind, str) and len(kind) <= 40 else "that type"
            raise ApiError(
                f"response_format {shown} is not supported by this server: it answers in free "
                'text only ({"type": "text"})',
                param="response_format",
            )
    tools = doc.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ApiError(f"tools must be a list, not {_type_name(tools)}", param="tools")
    choice = doc.get("tool_choice")
    if choice is not None and choice not in TOOL_CHOICES:
        what = repr(choice) if choice == "required" else "a named tool"
        if not (choice == "required" or isinstance(choice, dict)):
            raise ApiError(
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)}, required or an object",
                param="tool_choice",
            )
        raise ApiError(
            f"tool_choice {what} is not supported by this server: it cannot call tools, "
            "only answer in free text (tool_choice auto or none)",
            param="tool_choice",
        )
    call = doc.get("function_call")
    if call is not None and call not in TOOL_CHOICES:
        raise ApiError(
            "function_call is not supported by this server beyond auto or none: it cannot "
            "call functions, only answer in free text",
            param="function_call",
        )
    modalities = doc.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise ApiError(
            'modalities is not supported by this server beyond ["text"]', param="modalities"
        )
    if doc.get("audio") is not None:
        raise ApiError("audio is not supported by this server: it answers in text", param="audio")


def _stop(doc: dict[str, Any]) -> list[str]:
    value = doc.get("stop")
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError("stop must be a string or a list of strings", param="stop")
    if len(items) > 4:
        raise ApiError(f"stop takes at most 4 strings, got {len(items)}", param="stop")
    if any(s == "" for s in items):
        raise ApiError("stop strings must not be empty", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in items):
        raise ApiError(f"stop strings must be at most {MAX_STOP_CHARS} characters", param="stop")
    return [_text(s, "stop") for s in items]


def _common(doc: dict[str, Any], kind: Kind, max_tokens_field: str) -> dict[str, Any]:
    """The knobs both endpoints share."""
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(f"model must be a string, not {_type_name(model)}", param="model")
    if model is not None:
        _text(model, "model")
    _unsupported(doc)
    _output_shape(doc)
    n = _int(doc, "n")
    if n not in (None, 1):
        raise ApiError(f"n must be 1 (one answer per request), got {n}", param="n")
    stream = doc.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(f"stream must be a boolean, not {_type_name(stream)}", param="stream")
    return dict(
        kind=kind,
        model=model,
        max_tokens=_int(doc, max_tokens_field, minimum=1, maximum=MAX_TOKENS_LIMIT),
        temperature=_temperature(doc),
        top_p=_number(doc, "top_p", 1.0, 0.0, 1.0),
        stop=_stop(doc),
        stream=bool(stream),
        seed=_int(doc, "seed", minimum=SEED_RANGE[0], maximum=SEED_RANGE[1]),
    )


def parse_completion(doc: dict[str, Any]) -> Generation:
    """A ``/v1/completions`` body: ``prompt`` (a string, or a list holding one) and the knobs."""
    prompt = doc.get("prompt")
    if prompt is None:
        raise ApiError("prompt is required", param="prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise ApiError(
                "prompt must be a string or a list of exactly one string "
                "(one prompt per request; token arrays are not supported)",
                param="prompt",
            )
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(f"prompt must be a string, not {_type_name(prompt)}", param="prompt")
    return Generation(prompt=_text(prompt, "prompt"), **_common(doc, "completion", "max_tokens"))


def _content(value: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (what newer clients send)."""
    if isinstance(value, str):
        return _text(value, where)
    if isinstance(value, list):
        texts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise ApiError(f"{where}: only text content parts are supported", param=where)
            if not isinstance(part.get("text"), str):
                raise ApiError(f"{where}: a text part needs a string text", param=where)
            texts.append(_text(part["text"], where))
        return "".join(texts)
    raise ApiError(f"{where} must be a string, not {_type_name(value)}", param=where)


def parse_chat(doc: dict[str, Any]) -> Generation:
    """A ``/v1/chat/completions`` body: ``messages`` and the knobs (``max_completion_tokens``
    wins over the older ``max_tokens``)."""
    messages = doc.get("messages")
    if messages is None:
        raise ApiError("messages is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", param="messages")
    clean = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(f"{where} must be an object", param=where)
        role = message.get("role")
        role = "system" if role == "developer" else role  # OpenAI's newer name for system
        if role not in ROLES:
            raise ApiError(
                f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                param=f"{where}.role",
            )
        clean.append(
            {"role": role, "content": _content(message.get("content"), f"{where}.content")}
        )
    field_name = (
        "max_completion_tokens" if doc.get("max_completion_tokens") is not None else "max_tokens"
    )
    return Generation(messages=clean, **_common(doc, "chat", field_name))


def check_prompt_size(generation: Generation, context: int | None) -> None:
    """A prompt that cannot fit ``context`` tokens by its size alone: 400, before any tokenizer
    spends time on it (`planning.serve_plan.prompt_size_problem`). None: not known yet (the
    replica checks the same)."""
    if not context:
        return
    found = request_size_problem(generation.prompt, generation.messages, context)
    if found:
        raise ApiError(found[0], param=found[1])


def check_model(generation: Generation, served: str) -> None:
    """A request for another model than the one served: 404 ``model_not_found``."""
    if generation.model is not None and generation.model != served:
        raise ApiError(
            f"The model {generation.model!r} does not exist: this server serves {served!r}",
            status=404,
            param="model",
            code="model_not_found",
        )


def new_id(kind: Kind) -> str:
    """A response id: ``cmpl-…`` or ``chatcmpl-…``."""
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response(
    kind: Kind,
    *,
    id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    usage: dict[str, int],
) -> dict[str, Any]:
    """The whole answer: a ``text_completion`` or a ``chat.completion`` object."""
    if kind == "completion":
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        obj = "chat.completion"
    choice["finish_reason"] = finish_reason
    return {
        "id": id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def chunk(
    kind: Kind,
    *,
    id: str,
    created: int,
    model: str,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One streamed piece: a ``text_completion`` chunk or a ``chat.completion.chunk`` with a
    ``delta`` (``role`` only in the first chat chunk). The last carries ``finish_reason`` and
    ``usage``."""
    if kind == "completion":
        choice: dict[str, Any] = {"index": 0, "text": text or "", "logprobs": None}
        obj = "text_completion"
    else:
        delta: dict[str, str] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta}
        obj = "chat.completion.chunk"
    choice["finish_reason"] = finish_reason
    doc: dict[str, Any] = {
        "id": id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if usage is not None:
        doc["usage"] = usage
    return doc


def sse(doc: dict[str, Any]) -> bytes:
    """One server-sent event: ``data: {json}`` and a blank line."""
    return b"data: " + json_safe.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def models_list(name: str, created: int) -> dict[str, Any]:
    """``GET /v1/models``: the one model served."""
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": created, "owned_by": "homelab-dp"}],
    }
