"""The Responses API's translation without a broker: a Responses body -> the chat body that the
chat mapping takes, and chat chunks -> the Responses stream events (reasoning items, which the
broker tests' model does not write)."""

from __future__ import annotations

import json

import pytest

from inferline.producer.gateway.errors import OpenAIError
from inferline.producer.gateway.openai_mapping import chat_request
from inferline.producer.gateway.responses_events import EventStream, translate
from inferline.producer.gateway.responses_mapping import (
    assistant_turn,
    chat_body,
    output_items,
    response_object,
)

CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}'}


def test_items_become_chat_turns_and_the_chat_mapping_takes_them():
    body = {
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            CALL,
            {**CALL, "call_id": "call_2"},
            {"type": "function_call_output", "call_id": "call_1", "output": "1"},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "max_output_tokens": 9,
        "top_p": 0.5,
    }
    history = [{"role": "user", "content": "Before"}]
    chat = chat_body(body, history)
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "user", "system", "user", "assistant", "tool"]
    assert [c["id"] for c in chat["messages"][4]["tool_calls"]] == ["call_1", "call_2"]
    assert chat["tools"][0]["function"]["name"] == "f"
    mapped = chat_request(chat)
    assert (mapped.fields["max_tokens"], mapped.fields["top_p"]) == (9, 0.5)
    assert mapped.fields["response_format"]["json_schema"]["schema"]["properties"]["name"] == {
        "const": "f"
    }  # the named function is forced, as chat's tool_choice
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}
    both = chat_body({**body, "text": {"format": fmt}}, [])  # as instructor sends them
    assert "response_format" not in both and chat_request(both).fields["response_format"]
    chat = chat_body({"input": "Hi", "text": {"format": fmt}}, [])
    assert chat["response_format"]["json_schema"] == {
        k: fmt[k] for k in ("name", "schema", "strict")
    }


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": "x", "prompt": {"id": "p"}}, "prompt"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": [{"type": "input_image"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text"),
        ({"input": "x", "text": {"verbosity": "low"}}, "text"),
        ({"input": "x", "tools": [{"type": "file_search"}]}, "tools"),
        ({"input": "x", "tool_choice": "any"}, "tool_choice"),
        ({"input": []}, "input"),
        ({"input": "x", "n": 2}, "n"),
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
    ],
)
def test_what_is_not_supported_is_refused_by_name(body, param):
    with pytest.raises(OpenAIError) as err:
        chat_body(body, [])
    assert (err.value.status, err.value.param) == (400, param)


def test_accepted_no_ops_ask_for_nothing():
    body = {"input": "x", "truncation": "disabled", "include": [], "reasoning": {}}
    assert chat_body(body, [])["messages"] == [{"role": "user", "content": "x"}]


def test_an_answer_becomes_output_items_and_a_stored_turn():
    message = {
        "content": "Sure.",
        "reasoning_content": "think",
        "tool_calls": [{"id": "call_9", "function": {"name": "f", "arguments": "{}"}}],
    }
    items = output_items(message)
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    turn = assistant_turn(items)
    assert turn["content"] == "Sure." and turn["tool_calls"][0]["id"] == "call_9"


def chunk(**delta) -> str:
    finish = delta.pop("finish", None)
    body = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n"


async def test_chat_chunks_become_responses_events_in_order():
    calls = [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}]
    chunks = [
        chunk(role="assistant", content=""),
        chunk(reasoning_content="hm"),
        chunk(reasoning_content="m"),
        chunk(content="Hi"),
        chunk(tool_calls=calls),
        chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"a"'}}]),
        chunk(tool_calls=[{"index": 0, "function": {"arguments": ": 1}"}}]),
        chunk(finish="tool_calls"),
        'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 6}}\n\n',
        "data: [DONE]\n\n",
    ]

    async def source():
        for c in chunks:
            yield c

    stored = []

    async def on_end(response):
        stored.append(response["status"])

    response = response_object({"input": "x"}, "resp_1", "m")
    events = [
        json.loads(e.split("data: ", 1)[1])
        async for e in translate(source(), EventStream(response), on_end)
    ]
    kinds = [e["type"] for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
    ]
    assert kinds.count("response.function_call_arguments.delta") == 2
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and stored == ["completed"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "hmm"
    assert final["output"][2]["arguments"] == '{"a": 1}'
    assert final["usage"]["total_tokens"] == 10
    assert all(i["status"] == "completed" for i in final["output"])


async def test_an_error_mid_stream_fails_the_response():
    async def source():
        yield chunk(content="Hi")
        yield 'data: {"error": {"message": "boom", "code": "internal"}}\n\ndata: [DONE]\n\n'

    async def on_end(_response):
        return None

    response = response_object({"input": "x"}, "resp_1", "m")
    events = [
        json.loads(e.split("data: ", 1)[1])
        async for e in translate(source(), EventStream(response), on_end)
    ]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["error"] == {"code": "internal", "message": "boom"}
