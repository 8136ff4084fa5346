"""OpenAI's Responses API through a running gateway with the openai SDK and the OpenAI Agents SDK
(issue 50): a scripted stand-in worker on the real broker answers as a Hermes-format model does
(tests/kafka/test_gateway_tools.py), and sees each request, so the tests check what reaches it.
Stored responses are read back by a second gateway replica. tests/kafka/test_gateway_fields.py
has a json_schema `text.format` enforced by the real worker's grammar engine."""

from __future__ import annotations

import asyncio
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
from tests.kafka.test_gateway_tools import ONE, function
from tests.unit.test_client import stream

pytestmark = pytest.mark.kafka
MODEL = "SmolLM2-135M-Instruct"
TOOLS = [
    {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
    for t in (function("get_weather", ["Paris", "Oslo"]), function("get_time", ["Paris", "Oslo"]))
]
SLOW = "Take your time."  # the scripted model pauses before it answers this


def responses_model(req) -> list:
    """Text after a tool result, a Hermes call where tools are offered, a pause when asked."""
    last = req.messages[-1]
    if last.role == "tool":
        return stream(req.id, ["It is 18", "C in Paris."])
    if req.tools:
        return stream(req.id, ONE)
    if last.content == SLOW:
        return [30, *stream(req.id, ["late"])]
    if req.response_format is not None:
        return stream(req.id, ['{"city": ', '"Oslo"}'])
    return stream(req.id, ["Hel", "lo", "!"])


@pytest.fixture(scope="module")
async def replicas(kafka_bootstrap):
    """(client of gateway A, client of gateway B, scripted worker, gateway A's app): two
    replicas, one store."""
    topics = await make_topics(kafka_bootstrap)
    settings = gateway_settings(kafka_bootstrap, topics, tool_call_parser="hermes")
    async with ScriptedWorker(kafka_bootstrap, topics.requests, responses_model) as worker:
        a, b = await start_gateway(settings), await start_gateway(settings)
        try:
            yield (
                *(
                    openai.AsyncOpenAI(base_url=g[2], api_key="sk-acme", max_retries=0)
                    for g in (a, b)
                ),
                worker,
                a[0].config.app,
            )
        finally:
            await stop_gateway(*a[:2])
            await stop_gateway(*b[:2])
    await delete_topics(kafka_bootstrap, topics)


async def test_text_whole_and_streamed_with_its_events(replicas):
    aio, _, worker, _ = replicas
    out = await aio.responses.create(
        model=MODEL, input="Hi", instructions="Be brief.", max_output_tokens=7, temperature=0.5
    )
    assert (out.status, out.output_text, out.object) == ("completed", "Hello!", "response")
    assert (out.usage.input_tokens, out.usage.output_tokens, out.usage.total_tokens) == (2, 3, 5)
    req = worker.requests[-1]
    assert [(m.role, m.content) for m in req.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert (req.max_tokens, req.temperature) == (7, 0.5)
    events = [e async for e in await aio.responses.create(model=MODEL, input="Hi", stream=True)]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds.count("response.output_text.delta") == 3
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == "Hello!" and events[-1].response.usage.total_tokens


async def test_a_function_call_round_trip_continued_and_read_on_another_replica(replicas):
    aio, other, worker, _ = replicas
    first = await aio.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert first.output[0].type == "message" and first.output_text == "Let me check.\n"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18C"}
    async with other.responses.stream(  # on the other replica: the store is shared
        model=MODEL, input=[result], previous_response_id=first.id, tools=TOOLS
    ) as events:
        final = await events.get_final_response()
    assert final.output_text == "It is 18C in Paris." and final.previous_response_id == first.id
    sent = worker.requests[-1].messages
    assert [m.role for m in sent] == ["user", "assistant", "tool"]
    assert sent[1].tool_calls[0].id == sent[2].tool_call_id == call.call_id
    assert sent[1].tool_calls[0].function.arguments == '{"city": "Paris"}'
    got = await aio.responses.retrieve(final.id)  # stored by the replica that answered
    assert got.output_text == final.output_text and got.status == "completed"
    assert (await other.responses.delete(final.id)) is None
    with pytest.raises(openai.NotFoundError):
        await aio.responses.retrieve(final.id)


async def test_streamed_call_arguments_come_in_pieces(replicas):
    aio, _, _, _ = replicas
    events = [e async for e in await aio.responses.create(
        model=MODEL, input="Weather?", tools=TOOLS, stream=True, store=False
    )]  # fmt: skip
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Paris"}
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == "".join(pieces)
    assert events[-1].response.store is False
    with pytest.raises(openai.NotFoundError):
        await aio.responses.retrieve(events[-1].response.id)


async def test_text_format_reaches_the_worker_and_fields_are_refused_by_name(replicas):
    aio, _, worker, _ = replicas
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    fmt = {"type": "json_schema", "name": "place", "schema": schema, "strict": True}
    out = await aio.responses.create(model=MODEL, input="Where?", text={"format": fmt}, store=False)
    assert json.loads(out.output_text) == {"city": "Oslo"}
    assert worker.requests[-1].response_format.json_schema.schema_ == schema
    for kw, param in (
        ({"include": ["file_search_call.results"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": "x"}] * 2049}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"background": True, "store": False}, "background"),
    ):
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as err:
            await aio.responses.create(model=MODEL, **{"input": "x", **kw})
        assert err.value.body["param"] == param, kw


async def test_a_background_response_is_cancelled_from_another_replica(replicas):
    aio, other, worker, app = replicas
    cancels = app.state.gateway.metrics.cancels
    before = cancels._value.get()
    queued = await aio.responses.create(model=MODEL, input=SLOW, background=True)
    assert queued.status == "queued" and queued.background
    async with asyncio.timeout(30):
        while worker.requests[-1].messages[-1].content != SLOW:  # it reached the worker
            await asyncio.sleep(0.05)
    cancelled = await other.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    async with asyncio.timeout(30):
        while cancels._value.get() == before:  # the owner heard it and cancelled the request
            await asyncio.sleep(0.05)
    assert (await aio.responses.retrieve(queued.id)).status == "cancelled"
    with pytest.raises(openai.BadRequestError):  # only background ones
        await aio.responses.cancel((await aio.responses.create(model=MODEL, input="Hi")).id)


async def test_the_agents_sdk_runs_a_tool_through_the_responses_api(replicas):
    """The Agents SDK's default model (OpenAIResponsesModel): the model calls the tool, the SDK
    runs it and sends its output back, the model answers."""
    from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool

    aio, _, worker, _ = replicas
    seen = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return "18C"

    agent = Agent(
        name="weather",
        instructions="Answer with the tool.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=MODEL, openai_client=aio),
    )
    result = await Runner.run(
        agent, "Weather in Paris?", run_config=RunConfig(tracing_disabled=True)
    )
    assert seen == ["Paris"] and result.final_output == "It is 18C in Paris."
    assert worker.requests[-1].messages[-1].role == "tool"
