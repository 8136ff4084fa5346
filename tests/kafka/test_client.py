"""producer.client against the real broker: with a scripted stand-in worker (restarts, duplicates,
gaps and errors on demand), then against the real worker as a subprocess. The reassembly logic
without a broker: tests/unit/test_client.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from collections.abc import Callable

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from inferline.producer.client import (
    ClientTimeout,
    IncompleteStream,
    InferenceClient,
    Overloaded,
    PromptTooLong,
    RateLimited,
    RequestCancelled,
    per_request_topic,
)
from inferline.contract.schema import (
    Request,
    decode_cancel,
    decode_request,
    encode_event,
)

# --------------------------------------------------------------------------- event builders
from tests.unit.test_client import done, started, stream, tokens  # noqa: F401


Script = Callable[[Request], list]


def default_script(req: Request) -> list:
    words = [f"w{i} " for i in range(min(req.max_tokens, 5))]
    return stream(req.id, words)


class ScriptedWorker:
    """Reads the request topic (its own group) on the real broker and writes the events its script
    returns for each request to the request's reply topic: restarts, duplicates, gaps and errors
    on demand, which the real worker cannot be made to produce."""

    def __init__(self, bootstrap: str, request_topic: str, script: Script = default_script):
        self.bootstrap, self.request_topic, self.script = bootstrap, request_topic, script
        self.requests: list[Request] = []
        self._task: asyncio.Task | None = None
        self._replies: set[asyncio.Task] = set()

    async def __aenter__(self) -> ScriptedWorker:
        self._consumer = AIOKafkaConsumer(
            self.request_topic,
            bootstrap_servers=self.bootstrap,
            group_id=f"scripted-{uuid.uuid4().hex[:8]}",
            auto_offset_reset="earliest",
            enable_auto_commit=False,
        )
        self._producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, enable_idempotence=True)
        await self._consumer.start()
        await self._producer.start()
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        for task in (self._task, *self._replies):
            task.cancel()
        await asyncio.gather(self._task, *self._replies, return_exceptions=True)
        await self._consumer.stop()
        await self._producer.stop()

    async def _run(self) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=100)
            for record in (r for rs in batches.values() for r in rs):
                req = decode_request(record.value)
                self.requests.append(req)
                # concurrently: a script that pauses must not hold up the next request
                self._replies.add(asyncio.create_task(self._reply(req)))

    async def _reply(self, req: Request) -> None:
        for ev in self.script(req):
            if isinstance(ev, (int, float)):
                await self._producer.flush()
                await asyncio.sleep(ev)  # a pause in the script
                continue
            await self._producer.send(
                req.reply_topic,
                encode_event(ev),
                key=req.id.encode(),
                partition=req.reply_partition,
            )
        await self._producer.flush()


@pytest.fixture
async def kafka_topics(kafka_bootstrap, new_topic):
    return {
        "requests": await new_topic(2, prefix="creq"),
        "cancel": await new_topic(1, prefix="ccancel"),
    }


@contextlib.asynccontextmanager
async def scripted(kafka_bootstrap, kafka_topics, script: Script = default_script, **client_kw):
    async with ScriptedWorker(kafka_bootstrap, kafka_topics["requests"], script) as worker:
        async with InferenceClient(
            kafka_bootstrap,
            request_topic=kafka_topics["requests"],
            cancel_topic=kafka_topics["cancel"],
            **client_kw,
        ) as client:
            yield client, worker


async def read_cancels(bootstrap: str, topic: str, n: int = 1) -> list[str]:
    from tests.kafka_fixtures import consume_until

    records = await consume_until(bootstrap, topic, lambda rs: len(rs) >= n, timeout=15)
    return [decode_cancel(r.value).id for r in records]


@pytest.mark.kafka
async def test_shared_reply_topic_many_requests(kafka_bootstrap, kafka_topics):
    async with scripted(kafka_bootstrap, kafka_topics) as (client, worker):
        assert client.reply_topic.startswith("inferline.reply.")
        handles = await asyncio.gather(
            *(client.submit(f"prompt {i}", max_tokens=1 + i % 5) for i in range(40))
        )
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 60)
        for i, (h, r) in enumerate(zip(handles, results)):
            assert r.text == "".join(f"w{k} " for k in range(1 + i % 5))
            assert "".join([d async for d in h.text()]) == r.text
            assert r.client_ttft_s is not None and r.client_total_s >= r.client_ttft_s
        assert {r.reply_topic for r in worker.requests} == {client.reply_topic}
        assert client.in_flight == 0
        # the request on the wire: created_at set, everything else as submitted
        assert all(r.created_at and r.prompt.startswith("prompt") for r in worker.requests)


@pytest.mark.kafka
async def test_per_request_reply_topics(kafka_bootstrap, kafka_topics):
    async with scripted(kafka_bootstrap, kafka_topics, reply_topic="per-request") as (
        client,
        worker,
    ):
        handles = [await client.submit("hi", max_tokens=3) for _ in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 60)
        assert [r.text for r in results] == ["w0 w1 w2 "] * 3
        topics = {r.reply_topic for r in worker.requests}
        assert topics == {per_request_topic(h.id) for h in handles}
        for _ in range(50):  # retired in a batch shortly after done
            if not topics & client._replies.watched:
                break
            await asyncio.sleep(0.1)
        assert not topics & client._replies.watched


@pytest.mark.kafka
async def test_named_reply_topic_shared_by_two_clients(kafka_bootstrap, kafka_topics, new_topic):
    shared = await new_topic(3, prefix="shared-replies", reply=True)
    async with scripted(kafka_bootstrap, kafka_topics, reply_topic=shared) as (a, _):
        async with InferenceClient(
            kafka_bootstrap, request_topic=kafka_topics["requests"], reply_topic=shared
        ) as b:
            ha = [await a.submit("x", max_tokens=2) for _ in range(5)]
            hb = [await b.submit("y", max_tokens=4) for _ in range(5)]
            ra = await asyncio.wait_for(asyncio.gather(*(h.result() for h in ha)), 60)
            rb = await asyncio.wait_for(asyncio.gather(*(h.result() for h in hb)), 60)
    assert all(r.text == "w0 w1 " for r in ra) and all(r.text == "w0 w1 w2 w3 " for r in rb)


@pytest.mark.kafka
async def test_a_client_that_makes_no_topics_uses_one_made_ahead_and_names_what_is_missing(
    kafka_bootstrap, kafka_topics, new_topic
):
    from inferline.config.settings import Settings
    from inferline.producer.replies import ReplyTopicError

    settings = Settings(kafka={"bootstrap_servers": kafka_bootstrap, "create_reply_topics": False})
    ahead = await new_topic(2, prefix="ahead", reply=True)
    async with scripted(kafka_bootstrap, kafka_topics, reply_topic=ahead, settings=settings) as (
        client,
        _,
    ):
        result = await asyncio.wait_for((await client.submit("x", max_tokens=2)).result(), 60)
        assert result.text == "w0 w1 "
        with pytest.raises(ReplyTopicError, match="per-request reply topics are made at run"):
            await client.submit("x", reply_topic="per-request")
    assert await topic_exists(kafka_bootstrap, ahead)  # not deleted on close
    for reply_topic, said in (
        (None, "name a reply topic made ahead"),
        ("inferline.reply.nowhere-" + uuid.uuid4().hex[:8], "does not exist"),
    ):
        client = InferenceClient(
            kafka_bootstrap, reply_topic=reply_topic, settings=settings, request_topic="r"
        )
        with pytest.raises(ReplyTopicError, match=said):
            await client.start()
        await client.close()
        if reply_topic:
            assert not await topic_exists(kafka_bootstrap, reply_topic)


async def topic_exists(bootstrap: str, topic: str) -> bool:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return topic in await admin.list_topics()
    finally:
        await admin.close()


def restart_script(req: Request) -> list:
    """Attempt a1 dies mid-stream; a2 runs to the end; a zombie a1 event comes late; and a2's
    first two events are delivered twice (at least once)."""
    a1 = [started(req.id, "a1"), tokens(req.id, "lost ", 1, "a1")]
    a2 = stream(req.id, ["fresh ", "answer"], attempt="a2")
    return a1 + a2[:2] + [tokens(req.id, "zombie", 2, "a1")] + a2


@pytest.mark.kafka
async def test_new_attempt_through_kafka(kafka_bootstrap, kafka_topics):
    async with scripted(kafka_bootstrap, kafka_topics, restart_script) as (client, _):
        h = await client.submit("x")
        deltas = [(str(d), d.restart) async for d in h.text()]
        r = await h.result()
    assert deltas == [("lost ", False), ("", True), ("fresh ", False), ("answer", False)]
    assert (r.text, r.attempts, r.attempt, r.gaps) == ("fresh answer", 2, "a2", 0)
    assert r.duplicates == 2


def gap_script(req: Request) -> list:
    evs = stream(req.id, ["a", "b", "c"], whole=req.metadata.get("whole") == "1")
    return evs[:2] + evs[3:]


@pytest.mark.kafka
async def test_gap_through_kafka(kafka_bootstrap, kafka_topics):
    async with scripted(kafka_bootstrap, kafka_topics, gap_script) as (client, _):
        repaired = await (await client.submit("x", metadata={"whole": "1"})).result()
        broken = await client.submit("x")
        with pytest.raises(IncompleteStream):
            await broken.result()
    assert repaired.text == "abc" and repaired.gaps == 1


def error_script(req: Request) -> list:
    code = req.metadata["code"]
    return [done(req.id, 0, reason="rejected", error=(code, f"{code} it is"))]


@pytest.mark.kafka
async def test_rejections_raise_by_code(kafka_bootstrap, kafka_topics):
    async with scripted(kafka_bootstrap, kafka_topics, error_script) as (client, _):
        for code, cls in (
            ("prompt_too_long", PromptTooLong),
            ("rate_limited", RateLimited),
            ("overloaded", Overloaded),
        ):
            h = await client.submit("x", metadata={"code": code})
            with pytest.raises(cls, match=f"{code} it is"):
                await h.result()


def slow_script(req: Request) -> list:
    return [started(req.id), tokens(req.id, "a", 1), 30.0]


@pytest.mark.kafka
async def test_cancel_and_client_timeout(kafka_bootstrap, kafka_topics):
    async with scripted(kafka_bootstrap, kafka_topics, slow_script) as (client, _):
        h = await client.submit("x")
        await h.cancel()
        assert await read_cancels(kafka_bootstrap, kafka_topics["cancel"]) == [h.id]
        late = await client.submit("y", timeout=1.0)
        with pytest.raises(ClientTimeout) as info:
            await late.result()
        assert info.value.result.text == "a"
        # a client-side timeout also tells the workers to stop
        assert (await read_cancels(kafka_bootstrap, kafka_topics["cancel"], 2))[1] == late.id
        assert client.in_flight == 1  # h: cancelled on our side only when its done arrives


@pytest.mark.kafka
async def test_invalid_request_is_refused_before_sending(kafka_bootstrap, kafka_topics):
    from pydantic import ValidationError

    async with scripted(kafka_bootstrap, kafka_topics) as (client, worker):
        with pytest.raises(ValidationError):
            await client.submit("x", temperature=-1)
        with pytest.raises(ValueError, match="limit"):
            await client.submit("x" * 2_000_000)
        assert client.in_flight == 0


# --------------------------------------------------------------------------- the real worker


PACED_STEP_S = 0.05


@pytest.fixture
async def real_worker(kafka_bootstrap, new_topic, tmp_path):
    """Topics and a `python -m inferline.worker` subprocess whose engine steps take at least
    PACED_STEP_S (a long request is long on any machine); `spawn()` starts another, unpaced."""
    from tests.worker_fixtures import Topics, spawn_worker, wait_log

    topics = Topics(
        requests=await new_topic(1, prefix="wreq"),
        cancel=await new_topic(1, prefix="wcancel"),
        dlq=await new_topic(1, prefix="wdlq"),
        replies=await new_topic(1, prefix="wrep", reply=True),
    )
    procs = []
    group = f"g-{uuid.uuid4().hex[:8]}"

    async def spawn(env: dict | None = None):
        log = tmp_path / f"worker{len(procs)}.log"
        proc = spawn_worker(kafka_bootstrap, topics, log, env, kafka={"group_id": group})
        procs.append(proc)
        await wait_log(log, "worker.started", proc, timeout=180)
        return proc

    await spawn({"INFERLINE_FAULT_STEP_DELAY_S": str(PACED_STEP_S)})
    yield topics, spawn, procs
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        with contextlib.suppress(Exception):
            proc.wait(60)
        if proc.poll() is None:
            proc.kill()


def client_for(bootstrap: str, topics, **kw) -> InferenceClient:
    return InferenceClient(
        bootstrap, request_topic=topics.requests, cancel_topic=topics.cancel, **kw
    )


@pytest.mark.kafka
@pytest.mark.slow
async def test_real_worker_text_reassembles_and_cancels(kafka_bootstrap, real_worker):
    topics, _, _ = real_worker
    async with client_for(kafka_bootstrap, topics) as client:
        h = await client.submit("Explain Kafka in one sentence.", max_tokens=24, temperature=0)
        streamed = "".join([d async for d in h.text()])
        r = await h.result()
        assert r.text and streamed == r.text and r.finish_reason in ("stop", "length")
        assert r.usage.completion_tokens == len(r.token_ids) and r.attempts == 1 and r.gaps == 0
        long = await client.submit(
            "Count from one to one thousand.", max_tokens=400, ignore_eos=True, temperature=0
        )
        async for delta in long.text():
            if delta:
                break
        await long.cancel()
        with pytest.raises(RequestCancelled):
            await asyncio.wait_for(long.result(), 120)
        per = await client.submit(
            "Say hello.", max_tokens=8, temperature=0, reply_topic="per-request"
        )
        assert (await per.result()).text


# A worker SIGKILLed and another started: make chaos and make test-full (the suite's budget). In
# make test the client's restart handling runs against the scripted worker
# (test_new_attempt_through_kafka) and a real worker's kill and restart in test_worker_process.py.
@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.full
async def test_real_worker_restart_gives_new_attempt(kafka_bootstrap, real_worker):
    topics, spawn, procs = real_worker
    async with client_for(kafka_bootstrap, topics) as client:
        h = await client.submit(
            "Count from one to one thousand.", max_tokens=64, ignore_eos=True, temperature=0
        )
        deltas = []
        async for delta in h.text():
            deltas.append(delta)
            if len(deltas) == 3 and len(procs) == 1:
                os.kill(procs[0].pid, signal.SIGKILL)  # dies mid-generation, offset uncommitted
                await spawn()
        r = await asyncio.wait_for(h.result(), 300)
    assert r.attempts >= 2 and any(d.restart for d in deltas)
    assert r.finish_reason == "length" and r.usage.completion_tokens == 64
    restart_at = max(i for i, d in enumerate(deltas) if d.restart)
    assert "".join(deltas[restart_at:]) == r.text
