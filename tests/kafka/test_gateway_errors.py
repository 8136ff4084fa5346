"""The gateway's failure paths against the real broker and a real worker: a worker error (500),
overload and rate limits (429 with Retry-After), deadlines on either side (504), a prompt too
long (400), each whole and streamed; and a Prometheus scrape of /metrics whose counters move."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferline.producer import client as producer_client
from tests.gateway_fixtures import (  # noqa: F401 - fixtures
    delete_topics,
    fleet,
    gateway_settings,
    make_topics,
    start_gateway,
    stop_gateway,
)
from tests.kafka_fixtures import consume_until
from tests.worker_fixtures import start_worker  # noqa: F401 - fixture

pytestmark = pytest.mark.kafka

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Name three colours."}]
LONG = {"max_tokens": 400, "temperature": 0, "extra_body": {"ignore_eos": True}}
REQUESTS = "inferline_gateway_requests_total"


def client(url: str, key: str = "sk-acme") -> openai.AsyncOpenAI:
    # No retries: a 429 or 5xx must reach the test, not be retried away.
    return openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)


async def streamed_text(stream) -> str:
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def scrape(http: httpx.AsyncClient) -> dict[tuple, float]:
    response = await http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def moved(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


async def scrape_until(http: httpx.AsyncClient, before: dict, name: str, **labels) -> dict:
    """A scrape once ``name`` has moved: a stream is counted when the gateway closes it, on its
    own time after the client has read the end."""
    deadline = time.monotonic() + 30
    while True:
        after = await scrape(http)
        if moved(before, after, name, **labels) or time.monotonic() > deadline:
            return after
        await asyncio.sleep(0.1)


# --- worker error: 500 -------------------------------------------------------------------------


@pytest.fixture
def failing_engine(fleet, monkeypatch):
    """The fleet's engine raises in a step once a request has two tokens: the worker ends every
    running request with `error` (code `internal`) and serves on."""
    engine = fleet.worker.engine
    step = engine.step

    def failing_step():
        if any(
            seq.num_output_tokens >= 2
            for samples in list(engine.requests.values())
            for seq in samples
        ):
            raise RuntimeError("injected step failure")
        return step()

    monkeypatch.setattr(engine, "step", failing_step)


async def test_worker_error_is_500_whole_and_inside_a_started_stream(fleet, failing_engine):
    aio = client(fleet.url)
    async with httpx.AsyncClient(base_url=fleet.url.removesuffix("/v1")) as http:
        before = await scrape(http)
        with pytest.raises(openai.InternalServerError) as err:
            await aio.chat.completions.create(model=MODEL, messages=CHAT, **LONG)
        assert err.value.status_code == 500 and err.value.code == "internal"
        assert err.value.type == "server_error"
        stream = await aio.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **LONG)
        with pytest.raises(openai.APIError) as err:  # headers were sent: the error ends the stream
            await streamed_text(stream)
        assert err.value.code == "internal"
        after = await scrape_until(http, before, REQUESTS, endpoint="chat", status="500")
    # The metrics count the stream as failed too, not by the 200 of its headers.
    assert moved(before, after, REQUESTS, endpoint="chat", status="500") == 2


# --- 429 with Retry-After ----------------------------------------------------------------------


async def test_rate_limited_whole_answer_is_429(fleet):
    aio = client(fleet.url, key="sk-slow")
    await aio.completions.create(model=MODEL, prompt="Hi", max_tokens=1)  # the one of the burst
    with pytest.raises(openai.RateLimitError) as err:
        await aio.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert (
        err.value.code == "rate_limit_exceeded" and err.value.response.headers["retry-after"] == "1"
    )


# --- deadlines: 504 ----------------------------------------------------------------------------


async def test_deadline_inside_a_started_stream_ends_it_with_timeout(fleet, kafka_bootstrap):
    # Long enough for the stream to start on an idle worker, far too short for 400 tokens. (On a
    # starved machine the deadline may pass before the start: then a 504, the same code.)
    server, task, url = await start_gateway(
        gateway_settings(kafka_bootstrap, fleet.topics, request_timeout_s=3)
    )
    try:
        with pytest.raises(openai.APIError) as err:
            await streamed_text(
                await client(url).chat.completions.create(
                    model=MODEL, messages=CHAT, stream=True, **LONG
                )
            )
        assert err.value.code == "timeout"
    finally:
        await stop_gateway(server, task)


async def test_no_done_after_the_deadline_is_504_and_a_cancel(kafka_bootstrap, monkeypatch):
    """No worker at all: the gateway's own clock ends the request, whole or streamed (before
    any header), and cancels it on the fleet."""
    monkeypatch.setattr(producer_client, "DEADLINE_GRACE_S", 0.5)
    topics = await make_topics(kafka_bootstrap)
    try:
        server, task, url = await start_gateway(
            gateway_settings(kafka_bootstrap, topics, request_timeout_s=0.5)
        )
        try:
            aio = client(url)
            for stream in (False, True):
                with pytest.raises(openai.APIStatusError) as err:
                    await aio.chat.completions.create(
                        model=MODEL, messages=CHAT, max_tokens=4, stream=stream
                    )
                assert err.value.status_code == 504 and err.value.code == "timeout", stream
        finally:
            await stop_gateway(server, task)
        cancels = await consume_until(
            kafka_bootstrap, topics.cancel, lambda recs: len(recs) >= 2, timeout=30
        )
        assert len({r.key for r in cancels}) == 2
    finally:
        await delete_topics(kafka_bootstrap, topics)


# --- prompt too long: 400 ----------------------------------------------------------------------


async def test_prompt_too_long_streamed_is_400_before_any_header(fleet):
    long_chat = [
        {"role": "user", "content": "word " * 600}
    ]  # the test worker's max_model_len is 512
    with pytest.raises(openai.BadRequestError) as err:
        await client(fleet.url).chat.completions.create(
            model=MODEL, messages=long_chat, max_tokens=4, stream=True
        )
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"


# --- a Prometheus scrape -----------------------------------------------------------------------


async def hang_up_mid_stream(url: str) -> None:
    body = {"model": MODEL, "messages": CHAT, "stream": True, "max_tokens": 400, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": "Bearer sk-acme"}) as http:
        async with http.stream("POST", "/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get(
                    "content"
                ):
                    break


async def test_metrics_scrape_shows_the_counters_move(fleet):
    aio = client(fleet.url)
    async with httpx.AsyncClient(base_url=fleet.url.removesuffix("/v1")) as http:
        before = await scrape(http)
        await streamed_text(
            await aio.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, stream=True)
        )
        await aio.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        with pytest.raises(openai.BadRequestError):
            await aio.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
        with pytest.raises(openai.AuthenticationError):
            await client(fleet.url, key="sk-wrong").completions.create(model=MODEL, prompt="Hi")
        await hang_up_mid_stream(fleet.url)
        after = await scrape_until(http, before, "inferline_gateway_cancels_total")
    assert moved(before, after, REQUESTS, endpoint="chat", status="200") == 1
    assert (
        moved(before, after, REQUESTS, endpoint="chat", status="499") == 1
    )  # the client hung up mid-stream
    assert moved(before, after, REQUESTS, endpoint="completions", status="200") == 1
    assert moved(before, after, REQUESTS, endpoint="chat", status="400") == 1
    assert moved(before, after, REQUESTS, endpoint="completions", status="401") == 1
    assert moved(before, after, "inferline_gateway_cancels_total") == 1
    assert moved(before, after, "inferline_gateway_ttft_seconds_count") == 2
    assert moved(before, after, "inferline_gateway_request_seconds_count") == 5
    assert after[("inferline_gateway_in_flight", ())] == 0


# --- last: a worker of its own claims the shared model runner, which the fleet's worker loses ---


async def test_overloaded_worker_is_429_with_retry_after(kafka_bootstrap, start_worker):
    topics = await make_topics(kafka_bootstrap)
    try:
        # One running, two waiting; a pool full for 0.3 s sheds what else it reads.
        worker = await start_worker(
            topics,
            scheduler={"max_num_seqs": 1, "max_waiting": 2},
            lanes={"max_records": 0},  # no lanes: the pool alone fills
            limits={"overload_reject_after_s": 0.3},
        )
        server, task, url = await start_gateway(
            gateway_settings(kafka_bootstrap, topics, retry_after_s=7)
        )
        try:
            aio = client(url)

            async def one(i: int):
                return await aio.chat.completions.create(
                    model=MODEL,
                    messages=CHAT,
                    max_tokens=16,
                    temperature=0,
                    stream=i % 2 == 1,
                    extra_body={"ignore_eos": True},
                )

            # A whole (unstreamed) answer is in the worker before the rest arrive: which of the
            # concurrent eleven get the pool's seats is the broker's order, not the test's.
            first = asyncio.ensure_future(one(0))
            while not worker.requests.jobs and not first.done():
                await asyncio.sleep(0.01)
            rest = [one(i) for i in range(1, 12)]
            results = await asyncio.gather(first, *rest, return_exceptions=True)
        finally:
            await stop_gateway(server, task)
    finally:
        await delete_topics(kafka_bootstrap, topics)
    refused = [r for r in results if isinstance(r, Exception)]
    assert refused and len(refused) < len(results), results
    for exc in refused:
        assert isinstance(exc, openai.RateLimitError), repr(exc)
        assert exc.code == "overloaded" and exc.response.headers["retry-after"] == "7"
    assert {type(r).__name__ for r in results if not isinstance(r, Exception)} >= {"ChatCompletion"}
