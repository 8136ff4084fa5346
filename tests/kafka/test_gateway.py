"""The OpenAI-compatible gateway against the real broker and a real worker, driven by the
official `openai` package (sync and async clients) and, for what the SDK hides (hang-ups,
headers, metrics), by httpx."""

from __future__ import annotations

import asyncio
import json

import httpx
import msgpack
import openai
import pytest

from inferline.contract.schema import DoneEvent, decode_event
from tests.gateway_fixtures import (  # noqa: F401 - fixtures
    delete_topics,
    fleet,
    gateway_settings,
    make_topics,
    start_gateway,
    stop_gateway,
)
from tests.worker_fixtures import start_worker  # noqa: F401 - fixture
from tests.kafka_fixtures import consume_until

pytestmark = pytest.mark.kafka

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Name three colours."}]


def clients(url: str, key: str = "sk-acme") -> tuple[openai.OpenAI, openai.AsyncOpenAI]:
    # No retries: a 429 or 401 must reach the test, not be retried away.
    return (
        openai.OpenAI(base_url=url, api_key=key, max_retries=0),
        openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0),
    )


async def test_chat_streamed_equals_whole_sync_and_async(fleet):
    sync, aio = clients(fleet.url)
    # The sync client blocks: it runs in a thread while this loop serves the worker and gateway.
    whole = await asyncio.to_thread(
        sync.chat.completions.create, model=MODEL, messages=CHAT, max_tokens=12, temperature=0
    )
    assert whole.id.startswith("chatcmpl-") and whole.created > 0 and whole.model == MODEL
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 0 and 0 < whole.usage.completion_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    def sync_stream() -> str:
        stream = sync.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    assert await asyncio.to_thread(sync_stream) == choice.message.content

    chunks = [
        c
        async for c in await aio.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_completion_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    ]
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == choice.message.content
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert (
        not chunks[-1].choices
        and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])

    again = await aio.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        extra_body={"top_k": 5, "repetition_penalty": 1.0, "priority": 1},
    )
    assert again.choices[0].message.content == choice.message.content


async def test_legacy_completions(fleet):
    _, aio = clients(fleet.url)
    whole = await aio.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
        seed=1,
        stop=["\n\n"],
        user="u-1",
    )
    assert (
        whole.id.startswith("cmpl-") and whole.object == "text_completion" and whole.choices[0].text
    )
    assert 0 < whole.usage.completion_tokens <= 8
    streamed = [
        c
        async for c in await aio.completions.create(
            model=MODEL,
            prompt="The capital of France is",
            max_tokens=8,
            temperature=0,
            seed=1,
            stop=["\n\n"],
            stream=True,
        )
    ]
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    ids = await aio.completions.create(
        model=MODEL, prompt=[504, 3458, 282], max_tokens=4, temperature=0
    )
    assert ids.usage.prompt_tokens == 3


async def test_logprobs_whole_and_streamed(fleet):
    _, aio = clients(fleet.url)
    whole = await aio.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = whole.choices[0]
    content = choice.logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert (
        "".join(e.token for e in content) == choice.message.content
    )  # ASCII: tokens spell the text
    for e in content:  # greedy: the chosen token is the most likely one
        assert e.logprob <= 0 and len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert (
            e.top_logprobs[0].logprob == pytest.approx(e.logprob)
            and e.logprob >= e.top_logprobs[1].logprob - 1e-6
        )
        assert bytes(e.bytes).decode() == e.token
    chunks = [
        c
        async for c in await aio.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=8,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
    ]
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content
    ]
    plain = await aio.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=0
    )
    assert (
        plain.choices[0].logprobs is None
        and plain.choices[0].message.content == choice.message.content
    )

    legacy = await aio.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=1
    )
    lp = legacy.choices[0].logprobs
    assert (
        len(lp.tokens)
        == len(lp.token_logprobs)
        == len(lp.top_logprobs)
        == legacy.usage.completion_tokens
    )
    assert "".join(lp.tokens) == legacy.choices[0].text and lp.text_offset[0] == 0
    assert all(len(top) == 1 for top in lp.top_logprobs)


async def test_bad_requests_name_the_field(fleet):
    sync, aio = clients(fleet.url)
    with pytest.raises(openai.BadRequestError) as err:
        await aio.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    assert err.value.status_code == 400 and err.value.param == "temperature"
    assert "temperature" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        await asyncio.to_thread(sync.completions.create, model=MODEL, prompt="x", max_tokens=0)
    assert err.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        await aio.chat.completions.create(model=MODEL, messages=CHAT, n=17)
    assert err.value.param == "n"
    with pytest.raises(openai.BadRequestError) as err:
        await aio.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": 5}])
    assert err.value.param == "messages"
    with pytest.raises(openai.NotFoundError):
        await aio.chat.completions.create(model="gpt-4o", messages=CHAT)
    with pytest.raises(
        openai.BadRequestError
    ) as err:  # prompt too long for the worker (max_model_len 512)
        await aio.completions.create(model=MODEL, prompt="word " * 600, max_tokens=4)
    assert err.value.code == "context_length_exceeded"


async def test_keys_are_required_when_configured(fleet):
    async with httpx.AsyncClient(base_url=fleet.url) as http:
        refused = await http.post("/chat/completions", json={"model": MODEL, "messages": CHAT})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert (await http.get("/models")).status_code == 401
    _, aio = clients(fleet.url, key="sk-wrong")
    with pytest.raises(openai.AuthenticationError):
        await aio.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    _, aio = clients(fleet.url)
    assert [m.id for m in (await aio.models.list()).data] == [MODEL]


async def test_rate_limited_tenant_gets_429_with_retry_after(fleet):
    _, aio = clients(fleet.url, key="sk-slow")
    await aio.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=1
    )  # the one of the burst
    with pytest.raises(openai.RateLimitError) as err:
        await aio.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, stream=True)
    assert err.value.status_code == 429 and err.value.response.headers["retry-after"] == "1"


async def test_sixteen_concurrent_streams(fleet):
    _, aio = clients(fleet.url)
    prompts = [f"Count from {i} to {i + 3}." for i in range(8)] * 2

    async def one(prompt: str) -> tuple[str, int]:
        stream = await aio.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[
            -1
        ].usage.completion_tokens

    results = await asyncio.gather(*(one(p) for p in prompts))
    assert all(text and 0 < n <= 8 for text, n in results)
    assert results[:8] == results[8:]  # greedy: the same prompt, the same text, whatever the batch


async def test_hang_up_sends_a_cancel(fleet, kafka_bootstrap):
    registry = fleet.server.config.app.state.gateway.metrics.registry

    def streams_open() -> float:
        return registry.get_sample_value("inferline_gateway_streams_open")

    body = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    async with httpx.AsyncClient(
        base_url=fleet.url, headers={"Authorization": "Bearer sk-acme"}
    ) as http:
        async with http.stream("POST", "/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get(
                    "content"
                ):
                    request_id = json.loads(line[6:])["id"].removeprefix("chatcmpl-")
                    break
            assert streams_open() == 1
        # leaving the block closes the connection mid-stream
    cancels = await consume_until(
        kafka_bootstrap,
        fleet.topics.cancel,
        lambda recs: any(r.key == request_id.encode() for r in recs),
        timeout=30,
    )
    assert msgpack.unpackb([r for r in cancels if r.key == request_id.encode()][0].value) == {
        "v": 1,
        "id": request_id,
    }
    # ... and the worker stopped it well before its 400 tokens.
    reply_topic = next(
        iter(fleet.server.config.app.state.gateway.pool.clients.values())
    ).reply_topic

    def cancelled(recs) -> bool:
        return any(
            isinstance(e := decode_event(r.value), DoneEvent) and e.id == request_id for r in recs
        )

    records = await consume_until(kafka_bootstrap, reply_topic, cancelled, timeout=60)
    done = [
        e
        for r in records
        if isinstance(e := decode_event(r.value), DoneEvent) and e.id == request_id
    ][0]
    assert done.finish_reason == "cancelled" and done.usage.completion_tokens < 400
    assert streams_open() == 0  # the stream closed with the hang-up


async def test_health_ready_and_metrics(fleet):
    root = fleet.url.removesuffix("/v1")
    async with httpx.AsyncClient(base_url=root) as http:
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        assert (await http.get("/health")).json() == {
            "status": "ok"
        }  # vLLM's name, which guidellm probes
        assert (await http.get("/readyz")).status_code == 200
        metrics = (await http.get("/metrics")).text
    assert 'inferline_gateway_requests_total{endpoint="chat",status="200"}' in metrics
    assert "inferline_gateway_ttft_seconds_bucket" in metrics


async def test_shutdown_cancels_requests_in_flight(fleet, kafka_bootstrap):
    server, task, url = await start_gateway(gateway_settings(kafka_bootstrap, fleet.topics))
    _, aio = clients(url)
    stream = await aio.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = await anext(aiter(stream))
    request_id = first.id.removeprefix("chatcmpl-")
    server.should_exit = True
    with pytest.raises(openai.APIError):  # the stream ends with the cancel's error event
        async for _ in stream:
            pass
    await asyncio.wait_for(task, 60)
    cancels = await consume_until(
        kafka_bootstrap,
        fleet.topics.cancel,
        lambda recs: any(r.key == request_id.encode() for r in recs),
        timeout=30,
    )
    assert cancels


async def test_deadline_is_504(fleet, kafka_bootstrap):
    server, task, url = await start_gateway(
        gateway_settings(kafka_bootstrap, fleet.topics, request_timeout_s=0.5)
    )
    try:
        _, aio = clients(url)
        with pytest.raises(openai.APIStatusError) as err:
            await aio.chat.completions.create(
                model=MODEL,
                messages=CHAT,
                max_tokens=400,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
        assert err.value.status_code == 504 and err.value.code == "timeout"
    finally:
        await stop_gateway(server, task)


async def test_topic_tenancy_publishes_into_the_tenants_topic(kafka_bootstrap, start_worker):
    topics = await make_topics(kafka_bootstrap, tenants=("acme",))
    try:
        await start_worker(topics, kafka={"tenancy": "topic"})
        server, task, url = await start_gateway(
            gateway_settings(kafka_bootstrap, topics, tenancy="topic", api_keys={"sk-acme": "acme"})
        )
        try:
            (client,) = server.config.app.state.gateway.pool.clients.values()
            assert client.request_topic == f"{topics.requests}.acme"
            assert client.reply_topic.startswith("inferline.reply.acme.gateway-")
            _, aio = clients(url)
            whole = await aio.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=4, temperature=0
            )
            assert whole.choices[0].message.content and whole.usage.completion_tokens <= 4
        finally:
            await stop_gateway(server, task)
    finally:
        await delete_topics(kafka_bootstrap, topics, tenants=("acme",))
