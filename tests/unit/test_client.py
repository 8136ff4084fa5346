"""producer.client's reassembly logic, without a broker: attempts, gaps, duplicates, errors by
code. Against the real broker: tests/kafka/test_client.py."""

from __future__ import annotations

import asyncio

import pytest

from inferline.producer.client import (
    ClientTimeout,
    IncompleteStream,
    InferenceClient,
    Overloaded,
    PromptTooLong,
    RateLimited,
    RequestCancelled,
    RequestHandle,
    RequestRejected,
    RequestTimeout,
    WorkerError,
    error_for,
    per_request_topic,
)
from inferline.contract.schema import (
    DoneEvent,
    ErrorInfo,
    Request,
    StartedEvent,
    Timing,
    TokensEvent,
    Usage,
)

# --------------------------------------------------------------------------- event builders


def started(rid: str, attempt: str = "a1", seq: int = 0) -> StartedEvent:
    return StartedEvent(id=rid, attempt=attempt, seq=seq, worker="w", queue_s=0.01)


def tokens(
    rid: str, text: str, seq: int, attempt: str = "a1", ids: list[int] | None = None
) -> TokensEvent:
    return TokensEvent(
        id=rid, attempt=attempt, seq=seq, token_ids=ids if ids is not None else [seq], text=text
    )


def done(
    rid: str,
    seq: int,
    attempt: str = "a1",
    reason: str = "stop",
    text: str | None = None,
    error: tuple[str, str] | None = None,
) -> DoneEvent:
    return DoneEvent(
        id=rid,
        attempt=attempt,
        seq=seq,
        finish_reason=reason,
        text=text,
        usage=Usage(prompt_tokens=2, completion_tokens=3),
        timing=Timing(queue_s=0.01, ttft_s=0.1, total_s=0.3),
        error=ErrorInfo(code=error[0], message=error[1]) if error else None,
    )


def stream(rid: str, words: list[str], attempt: str = "a1", whole: bool = True) -> list:
    """A well-formed attempt: started, one tokens event per word, done."""
    evs = [started(rid, attempt)] + [tokens(rid, w, i + 1, attempt) for i, w in enumerate(words)]
    return evs + [done(rid, len(words) + 1, attempt, text="".join(words) if whole else None)]


def new_handle(rid: str = "r1") -> RequestHandle:
    return RequestHandle(Request(id=rid, reply_topic="t", prompt="x"))


async def drain_text(handle: RequestHandle) -> list:
    return [d async for d in handle.text()]


# --------------------------------------------------------------------------- reassembly, no broker


async def test_text_reassembles():
    h = new_handle()
    for ev in stream("r1", ["Hel", "lo", "!"]):
        assert h.feed(ev)
    assert [str(d) for d in await drain_text(h)] == ["Hel", "lo", "!"]
    r = await h.result()
    assert (r.text, r.finish_reason, r.attempts, r.gaps, r.duplicates) == (
        "Hello!",
        "stop",
        1,
        0,
        0,
    )
    assert r.usage.completion_tokens == 3 and r.token_ids == [1, 2, 3]


async def test_readers_follow_live_events():
    h = new_handle()
    reader = asyncio.create_task(drain_text(h))
    for ev in stream("r1", ["a", "b"]):
        await asyncio.sleep(0)
        h.feed(ev)
    assert [str(d) for d in await asyncio.wait_for(reader, 2)] == ["a", "b"]
    assert [e.type for e in [e async for e in h.events()]] == [
        "started",
        "tokens",
        "tokens",
        "done",
    ]


async def test_duplicates_are_ignored():
    h = new_handle()
    for ev in stream("r1", ["a", "b"]):
        assert h.feed(ev)
        assert not h.feed(ev)
    r = await h.result()
    # nothing counts after the final done: the end is the end
    assert r.text == "ab" and r.duplicates == 3 and len(h.log) == 4


async def test_new_attempt_discards_old_text_and_says_so():
    h = new_handle()
    for ev in [started("r1", "a1"), tokens("r1", "old ", 1, "a1"), tokens("r1", "text", 2, "a1")]:
        h.feed(ev)
    for ev in stream("r1", ["new"], attempt="a2"):
        h.feed(ev)
    deltas = await drain_text(h)
    assert [(str(d), d.restart) for d in deltas] == [
        ("old ", False),
        ("text", False),
        ("", True),
        ("new", False),
    ]
    assert deltas[-1].attempt == "a2"
    r = await h.result()
    assert (r.text, r.attempt, r.attempts, r.token_ids) == ("new", "a2", 2, [1])


async def test_zombie_attempt_events_are_ignored():
    h = new_handle()
    h.feed(started("r1", "a1"))
    h.feed(started("r1", "a2"))
    assert not h.feed(tokens("r1", "zombie", 1, "a1"))
    assert not h.feed(done("r1", 2, "a1", text="zombie"))
    assert not h.finished
    for ev in stream("r1", ["ok"], attempt="a2")[1:]:
        h.feed(ev)
    assert (await h.result()).text == "ok"


async def test_requeued_done_waits_for_the_next_attempt():
    h = new_handle()
    for ev in [
        started("r1", "a1"),
        tokens("r1", "x", 1, "a1"),
        done("r1", 2, "a1", reason="requeued"),
    ]:
        h.feed(ev)
    assert not h.finished
    for ev in stream("r1", ["y"], attempt="a2"):
        h.feed(ev)
    r = await h.result()
    assert (r.text, r.attempts, r.finish_reason) == ("y", 2, "stop")


async def test_a_late_requeued_of_an_older_attempt_never_ends_the_live_one():
    h = new_handle()
    h.feed(started("r1", "a2"))  # a2 runs; a1's `requeued` arrives late (another partition order)
    assert not h.feed(done("r1", 3, "a1", reason="requeued"))
    assert not h.feed(tokens("r1", "stray", 2, "a1"))  # an older attempt's tail: never a new start
    for ev in stream("r1", ["live"], attempt="a2")[1:]:
        assert h.feed(ev)
    r = await h.result()
    assert (r.text, r.attempt, r.attempts, r.finish_reason) == ("live", "a2", 1, "stop")


async def test_a_resent_final_done_alone_is_the_answer():
    h = new_handle()
    assert h.feed(done("r1", 4, "a1", text="answered before"))  # a resubmission's re-sent final
    r = await h.result()
    assert (r.text, r.attempt, r.gaps, r.finish_reason) == ("answered before", "a1", 0, "stop")


async def test_gap_repaired_by_done_text():
    h = new_handle()
    evs = stream("r1", ["a", "b", "c"])
    for ev in evs[:2] + evs[3:]:  # tokens "b" lost
        h.feed(ev)
    r = await h.result()
    assert r.gaps == 1 and r.text == "abc"


async def test_gap_without_whole_text_raises():
    h = new_handle()
    evs = stream("r1", ["a", "b", "c"], whole=False)
    for ev in evs[:2] + evs[3:]:
        h.feed(ev)
    with pytest.raises(IncompleteStream) as info:
        await h.result()
    assert info.value.result.text == "ac"
    assert (await h.result(check=False)).gaps == 1


async def test_missing_started_is_a_gap():
    h = new_handle()
    for ev in stream("r1", ["a"])[1:]:
        h.feed(ev)
    assert (await h.result()).gaps == 1


async def test_stream_false_text_comes_in_done():
    h = new_handle()
    h.feed(started("r1"))
    h.feed(done("r1", 1, text="whole answer"))
    assert [str(d) for d in await drain_text(h)] == ["whole answer"]


async def test_nothing_after_final_done():
    h = new_handle()
    for ev in stream("r1", ["a"]):
        h.feed(ev)
    assert not h.feed(started("r1", "a2"))
    assert (await h.result()).attempts == 1


@pytest.mark.parametrize(
    "reason,error,cls",
    [
        ("rejected", ("invalid_request", "temperature: bad"), RequestRejected),
        ("rejected", ("prompt_too_long", "too long"), PromptTooLong),
        ("rejected", ("rate_limited", "slow down"), RateLimited),
        ("rejected", ("overloaded", "busy"), Overloaded),
        ("timeout", ("timeout", "deadline"), RequestTimeout),
        ("timeout", None, RequestTimeout),
        ("cancelled", None, RequestCancelled),
        ("cancelled", ("cancelled", "by user"), RequestCancelled),
        ("error", ("internal", "boom"), WorkerError),
        ("error", None, WorkerError),
        ("rejected", None, RequestRejected),
        ("rejected", ("timeout", "deadline passed in the queue"), RequestTimeout),
    ],
)
async def test_errors_by_contract_code(reason, error, cls):
    h = new_handle()
    h.feed(started("r1"))
    h.feed(tokens("r1", "part", 1))
    h.feed(done("r1", 2, reason=reason, error=error))
    with pytest.raises(cls) as info:
        await h.result()
    exc = info.value
    assert (
        exc.request_id == "r1" and exc.result.text == "part" and exc.result.finish_reason == reason
    )
    assert exc.code == (
        error[0]
        if error
        else {"timeout": "timeout", "cancelled": "cancelled"}.get(reason, exc.code)
    )
    with pytest.raises(cls):
        await drain_text(h)
    assert [e.type async for e in h.events()][-1] == "done"  # events() does not raise worker errors


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_success_reasons(reason):
    assert error_for(done("r", 1, reason=reason)) is None


async def test_client_side_failure_ends_readers():
    h = new_handle()
    h.feed(started("r1"))
    reader = asyncio.create_task(drain_text(h))
    await asyncio.sleep(0)
    h.fail(ClientTimeout("no done"))
    with pytest.raises(ClientTimeout):
        await asyncio.wait_for(reader, 2)
    with pytest.raises(ClientTimeout):
        async for _ in h.events():
            pass
    assert (await h.result(check=False)).finish_reason == "timeout"


def test_per_request_topic_names_are_legal():
    from inferline.contract.schema import is_legal_topic

    assert is_legal_topic(per_request_topic("a:b.c-" + "x" * 122))


def test_reply_topics_follow_the_workers_reply_prefix():
    """The client's own and per-request reply topics go under INFERLINE_KAFKA__REPLY_TOPIC_PREFIX:
    the only topics a worker answers on."""
    from inferline.config.settings import Settings

    client = InferenceClient(settings=Settings(kafka={"reply_topic_prefix": "acme.replies."}))
    assert client.reply_topic == "acme.replies." + client.client_uid
    assert per_request_topic("r:1", client.reply_prefix) == "acme.replies.r_1"
    assert InferenceClient(settings=Settings()).reply_topic.startswith("inferline.reply.")


# ------------------------------------------------------------------------- scripted stand-in worker


async def test_a_reply_topic_made_just_now_is_waited_for_where_the_asked_broker_lags(monkeypatch):
    """On a cluster, a broker may not know a topic another just created (the 3-node replication
    test hit it: 'does not exist' right after the create): the client asks again."""
    from inferline.producer import replies

    answers = iter([None, None, [0, 1]])

    async def created(admin, topics, **kwargs):
        return [name for name, _ in topics]

    async def partitions(admin, topic):
        return next(answers)

    reassigned = []

    async def reassign(self, add=(), remove=frozenset(), from_start=True):
        reassigned.extend(add)

    monkeypatch.setattr(replies, "create_topics", created)
    monkeypatch.setattr(replies, "topic_partitions", partitions)
    monkeypatch.setattr(replies.ReplyRouter, "_reassign", reassign)
    router = replies.ReplyRouter(
        None,
        None,
        {},
        lambda c: None,
        partitions=2,
        retention_ms=1,
        replication_factor=None,
        min_insync_replicas=None,
        max_event_bytes=1,
    )
    await router.watch_shared("inferline.reply.t", fresh=True)
    assert [tp.partition for tp in reassigned] == [0, 1]
