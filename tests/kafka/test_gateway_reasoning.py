"""Reasoning output through a running gateway (issue 50, item 4): a scripted stand-in worker on
the real broker answers as a reasoning model does (`<think>...</think>` then the answer, in token
pieces that cut the tags); the gateway (INFERLINE_GATEWAY__REASONING_PARSER=think) returns the
thinking in `reasoning_content` and the answer in `content`, whole and streamed, and passes
`chat_template_kwargs` through to the request."""

from __future__ import annotations

import json

import httpx
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
PIECES = ["<th", "ink>Two and", " two make four.</", "think>", "\n\n4"]


def reasoning_model(req) -> list:
    return stream(req.id, PIECES)


async def test_a_reasoning_models_thinking_goes_to_reasoning_content(kafka_bootstrap):
    topics = await make_topics(kafka_bootstrap)
    settings = gateway_settings(kafka_bootstrap, topics, reasoning_parser="think")
    async with ScriptedWorker(kafka_bootstrap, topics.requests, reasoning_model) as worker:
        server, task, url = await start_gateway(settings)
        body = {
            "messages": [{"role": "user", "content": "2 + 2?"}],
            "chat_template_kwargs": {"enable_thinking": True},
        }
        headers = {"Authorization": "Bearer sk-acme"}
        try:
            async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
                whole = (await http.post("/chat/completions", json=body)).json()
                async with http.stream(
                    "POST", "/chat/completions", json={**body, "stream": True}
                ) as response:
                    lines = [ln async for ln in response.aiter_lines() if ln.startswith("data: {")]
        finally:
            await stop_gateway(server, task)
    await delete_topics(kafka_bootstrap, topics)
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (
        "Two and two make four.",
        "\n\n4",
    )
    deltas = [json.loads(ln[6:])["choices"][0]["delta"] for ln in lines]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two make four."
    assert "".join(d.get("content") or "" for d in deltas) == "\n\n4"
    assert all("<" not in d.get("content", "") for d in deltas)
    assert {r.chat_template_kwargs["enable_thinking"] for r in worker.requests} == {True}
