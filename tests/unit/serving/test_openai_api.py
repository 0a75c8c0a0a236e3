"""The OpenAI-compatible surface: what a request may hold, and the shapes of the answers."""

from __future__ import annotations

import json

import pytest

from homelab_dp.serving.front import openai_api as api


def completion(**fields) -> api.Generation:
    return api.parse_completion({"prompt": "Hello", **fields})


def chat(**fields) -> api.Generation:
    return api.parse_chat({"messages": [{"role": "user", "content": "Hi"}], **fields})


def refused(call, *args, **kwargs) -> api.ApiError:
    with pytest.raises(api.ApiError) as info:
        call(*args, **kwargs)
    return info.value


def test_a_completion_with_every_knob_becomes_the_replica_body() -> None:
    g = completion(
        model="m",
        max_tokens=16,
        temperature=0,
        top_p=0.9,
        stop="\n",
        stream=True,
        seed=3,
        n=1,
        user="someone",
        logprobs=None,
        stream_options={"include_usage": True},
    )
    assert (g.kind, g.model, g.stream) == ("completion", "m", True)
    assert g.replica_body() == {
        "prompt": "Hello",
        "messages": None,
        "max_tokens": 16,
        "temperature": 0.0,
        "top_p": 0.9,
        "stop": ["\n"],
        "seed": 3,
    }


def test_defaults_and_nulls_mean_the_same() -> None:
    plain = completion()
    nulls = completion(max_tokens=None, temperature=None, top_p=None, stop=None, seed=None, n=None)
    assert plain == nulls
    assert plain.replica_body() == {
        "prompt": "Hello",
        "messages": None,
        "max_tokens": None,
        "temperature": 1.0,
        "top_p": 1.0,
        "stop": [],
        "seed": None,
    }


def test_a_prompt_list_of_one_is_that_prompt() -> None:
    assert api.parse_completion({"prompt": ["Once"]}).prompt == "Once"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": None}, "prompt"),
        ({"prompt": 3}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"max_tokens": "16"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 2}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stop": ["a", 1]}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"seed": "7"}, "seed"),
        ({"model": 5}, "model"),
    ],
)
def test_a_bad_completion_field_is_a_400_naming_it(fields, param) -> None:
    error = refused(api.parse_completion, {"prompt": "Hello", **fields})
    assert (error.status, error.param, error.type) == (400, param, "invalid_request_error")
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["param"] == param


def test_the_prompt_is_required() -> None:
    assert refused(api.parse_completion, {"max_tokens": 3}).param == "prompt"


def test_chat_messages_and_content_parts() -> None:
    g = api.parse_chat(
        {
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
                },
                {"role": "assistant", "content": "Hello", "name": "bot"},
            ],
            "max_completion_tokens": 5,
            "max_tokens": 99,
        }
    )
    assert g.kind == "chat" and g.prompt is None and g.max_tokens == 5
    assert g.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello"},
    ]
    assert chat(max_tokens=7).max_tokens == 7


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ([], "messages"),
        ("hi", "messages"),
        (["hi"], "messages[0]"),
        ([{"role": "tool", "content": "x"}], "messages[0].role"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
    ],
)
def test_bad_messages_are_a_400_naming_the_message(messages, param) -> None:
    doc = {} if messages is None else {"messages": messages}
    error = refused(api.parse_chat, doc)
    assert (error.status, error.param) == (400, param)


def test_chat_knobs_are_checked_like_completions() -> None:
    assert refused(chat, max_completion_tokens=0).param == "max_completion_tokens"
    assert refused(chat, temperature=3).param == "temperature"


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b"\xff\xfe", b'"text"', b""])
def test_a_body_that_is_not_a_json_object_is_a_400(raw) -> None:
    assert refused(api.parse_json, raw).status == 400


def test_another_model_is_a_404_model_not_found() -> None:
    api.check_model(completion(), "tiny")
    api.check_model(completion(model="tiny"), "tiny")
    error = refused(api.check_model, completion(model="gpt-4"), "tiny")
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model")


def test_whole_answers_have_openai_shapes() -> None:
    usage = api.usage(5, 3)
    assert usage == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    meta = dict(id="cmpl-1", created=7, model="tiny", text="ok", finish_reason="stop", usage=usage)
    doc = api.response("completion", **meta)
    assert doc["object"] == "text_completion" and doc["usage"] == usage
    assert doc["choices"] == [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "stop"}]
    doc = api.response("chat", **meta)
    assert doc["object"] == "chat.completion"
    assert doc["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
    ]
    assert {"id", "object", "created", "model", "choices", "usage"} == set(doc)


def test_stream_chunks_and_events() -> None:
    meta = dict(id="chatcmpl-1", created=7, model="tiny")
    first = api.chunk("chat", **meta, role=True, text="")
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert api.chunk("chat", **meta, text="He")["choices"][0]["delta"] == {"content": "He"}
    last = api.chunk("chat", **meta, finish_reason="length", usage=api.usage(1, 2))
    assert last["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "length"}
    assert last["usage"]["total_tokens"] == 3
    text = api.chunk("completion", **meta, text="He")
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "He"
    assert "usage" not in text
    event = api.sse(text)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:]) == text
    assert api.SSE_DONE == b"data: [DONE]\n\n"


def test_ids_and_models_list() -> None:
    assert api.new_id("completion").startswith("cmpl-")
    assert api.new_id("chat").startswith("chatcmpl-")
    assert api.new_id("chat") != api.new_id("chat")
    assert api.models_list("tiny", 5) == {
        "object": "list",
        "data": [{"id": "tiny", "object": "model", "created": 5, "owned_by": "homelab-dp"}],
    }


# Issue 34, item 9: an answer shape the server cannot produce is a 400 naming the field, never a
# 200 with free text (every kind: JSON modes, tool calls demanded, the older function_call,
# audio; wrong types; a huge type name, which the message never echoes).
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": SCHEMA}, "response_format"),
        ({"response_format": {"type": "x" * 100_000}}, "response_format"),
        ({"response_format": {"type": 5}}, "response_format"),
        ({"response_format": {}}, "response_format"),
        ({"response_format": "json_object"}, "response_format"),
        ({"response_format": ["text"]}, "response_format"),
        ({"tools": [FUNCTION], "tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [FUNCTION], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
        ),  # fmt: skip
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [FUNCTION], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [FUNCTION], "tool_choice": 1}, "tool_choice"),
        ({"tools": FUNCTION}, "tools"),
        ({"tools": "f"}, "tools"),
        ({"functions": [FUNCTION["function"]], "function_call": {"name": "f"}}, "function_call"),
        ({"function_call": "required"}, "function_call"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"modalities": "text"}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ],
)
def test_an_answer_shape_it_cannot_produce_is_a_400_naming_the_field(fields, param) -> None:
    for parse, base in ((api.parse_chat, {"messages": [{"role": "user", "content": "Hi"}]}),
                        (api.parse_completion, {"prompt": "Hi"})):  # fmt: skip
        error = refused(parse, {**base, **fields})
        assert (error.status, error.param) == (400, param), error.message
        assert len(error.message) < 300  # a hostile value is named, not echoed


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "text"}},
        {"response_format": None},
        {"tools": [FUNCTION]},  # auto by default: free text is an answer
        {"tools": [FUNCTION], "tool_choice": "auto"},
        {"tools": [FUNCTION], "tool_choice": "none"},
        {"tools": [], "tool_choice": None},
        {"functions": [FUNCTION["function"]], "function_call": "auto"},
        {"modalities": ["text"], "audio": None, "parallel_tool_calls": True},
    ],
)
def test_free_text_compatible_shapes_pass(fields) -> None:
    assert chat(**fields).messages == [{"role": "user", "content": "Hi"}]
