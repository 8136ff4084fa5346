"""Tool calling through a running gateway with the openai SDK (issue 50, item 1). A scripted
stand-in worker on the real broker answers as a Hermes-format model does (`<tool_call>` JSON, in
token pieces that cut the tags and the arguments), or with the JSON the grammar would force when
the request carries the constraint for tool_choice `required` or a named function; the worker sees
each request, so the tests check what reaches it. tests/kafka/test_gateway_fields.py has a named
call made by the real worker's grammar engine."""

from __future__ import annotations

import json

import openai
import pytest

from tests.gateway_fixtures import (
    delete_topics,
    gateway_settings,
    make_topics,
    start_gateway,
    stop_gateway,
)
from tests.kafka.test_client import ScriptedWorker
from tests.unit.test_client import stream

pytestmark = pytest.mark.kafka
MODEL = "SmolLM2-135M-Instruct"


def function(name: str, cities: list[str]) -> dict:
    params = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": cities}},
        "required": ["city"],
        "additionalProperties": False,
    }
    return {"type": "function", "function": {"name": name, "parameters": params, "strict": True}}


TOOLS = [function("get_weather", ["Paris", "Oslo"]), function("get_time", ["Paris", "Oslo"])]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
BOTH = [{"role": "user", "content": "Weather in Paris and Oslo, both?"}]
ONE = ["Let me check.\n<tool", '_call>\n{"name": "get_', 'weather", "arguments": {"ci', 'ty": "Par']
ONE += ['is"}}\n</tool_', "call>"]
OSLO = ['\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "O', 'slo"}}\n</tool_call>']
FORCED = '{"name":"get_weather","parameters":{"city":"Paris"}}'


def tool_model(req) -> list:
    """Answers as the model would: text after a tool result, a forced call where the request
    carries the grammar for one, else Hermes-format calls (two when asked for both)."""
    last = req.messages[-1]
    if last.role == "tool":
        return stream(req.id, ["It is 18", "C in Paris."])
    if req.response_format is not None:
        schema = req.response_format.json_schema.schema_
        text = f"[{FORCED}]" if schema.get("type") == "array" else FORCED
        return stream(req.id, [text[:20], text[20:37], text[37:]])
    return stream(req.id, ONE + (OSLO if "both" in last.content else []))


@pytest.fixture(scope="module")
async def scripted(kafka_bootstrap):
    """(openai client, scripted worker) behind a running gateway, shared by the module."""
    topics = await make_topics(kafka_bootstrap)
    settings = gateway_settings(kafka_bootstrap, topics, tool_call_parser="hermes")
    async with ScriptedWorker(kafka_bootstrap, topics.requests, tool_model) as worker:
        server, task, url = await start_gateway(settings)
        try:
            yield openai.AsyncOpenAI(base_url=url, api_key="sk-acme", max_retries=0), worker
        finally:
            await stop_gateway(server, task)
    await delete_topics(kafka_bootstrap, topics)


def calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


async def streamed(aio: openai.AsyncOpenAI, **kw):
    """The SDK's stream helper: (final completion, how many argument pieces came)."""
    async with aio.chat.completions.stream(model=MODEL, **kw) as events:
        kind = "tool_calls.function.arguments.delta"
        pieces = [e async for e in events if e.type == kind and e.arguments_delta]
        return await events.get_final_completion(), len(pieces)


async def test_auto_calls_one_and_parallel_whole_and_streamed(scripted):
    aio, worker = scripted
    whole = await aio.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
    assert calls(choice.message) == [("get_weather", {"city": "Paris"})]
    assert choice.message.tool_calls[0].id.startswith("call_")
    final, pieces = await streamed(aio, messages=BOTH, tools=TOOLS)
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and pieces > 2  # the arguments in pieces
    assert calls(choice.message) == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert choice.message.tool_calls[1].function.parsed_arguments == {"city": "Oslo"}
    assert choice.message.content == "Let me check.\n"  # no tag leaked into the text
    req = worker.requests[-1]  # the tools reach the worker, in the gateway's format
    assert [t.function.name for t in req.tools] == ["get_weather", "get_time"]
    assert req.tool_format == "hermes" and req.response_format is None


async def test_a_tool_result_goes_back_and_the_answer_comes(scripted):
    aio, worker = scripted
    first = await aio.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    message = first.choices[0].message
    result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18C"}
    turns = [*ASK, message.model_dump(exclude_none=True), result]
    final, _ = await streamed(aio, messages=turns, tools=TOOLS)
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
    assert final.choices[0].message.content == "It is 18C in Paris."
    sent = worker.requests[-1].messages
    assert sent[1].tool_calls[0].id == sent[2].tool_call_id == message.tool_calls[0].id
    assert sent[1].tool_calls[0].function.arguments == '{"city": "Paris"}'


async def test_required_and_named_send_the_grammar_that_forces_a_call(scripted):
    aio, worker = scripted
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = await aio.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named
    )
    assert calls(whole.choices[0].message) == [("get_weather", {"city": "Paris"})]
    assert whole.choices[0].finish_reason == "tool_calls"
    schema = worker.requests[-1].response_format.json_schema.schema_
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["parameters"] == TOOLS[0]["function"]["parameters"]
    final, _ = await streamed(aio, messages=ASK, tools=TOOLS, tool_choice="required")
    assert calls(final.choices[0].message) == [("get_weather", {"city": "Paris"})]
    schema = worker.requests[-1].response_format.json_schema.schema_
    assert schema["type"] == "array" and len(schema["items"]["anyOf"]) == 2  # parallel: a list
    with pytest.raises(openai.BadRequestError) as err:
        await aio.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert err.value.param == "tool_choice"
