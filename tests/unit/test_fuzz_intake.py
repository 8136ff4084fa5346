"""Fuzzing the intake: hostile messages through decode_request and the worker's triage.

Offline (no broker, no model): at least 10,000 generated and mutated messages go through the real
`Intake._handle` of a real `Worker` (decode, validation, triage, rejection / dead letter /
admission, reply building and msgpack encoding, offset tracking); admitted requests are tokenized by
the real `LLMEngine.tokenize` and completed through the worker's engine-output path. Every message
must end as exactly one of: dead letter, a `done` that never ran (rejected / timeout / cancelled),
or a request that runs and gets its `done`; nothing may raise, every offset must be finished, memory
stays bounded.

Online: tests/kafka/test_fuzz_intake.py sends a few hundred hostile messages into a running
worker; each ends as a dead letter or a `done`, and the worker serves a valid request afterwards.

Scale with INFERLINE_FUZZ_SCALE (default 1; `make chaos` style long runs: 10).
"""

from __future__ import annotations

import gc
import os
import random
import sys
import tracemalloc
import types
from collections import Counter

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferline.config.settings import Settings
from inferline.worker.delivery.dead_letters import batch_size
from inferline.contract.schema import (
    ERROR_CODES,
    DoneEvent,
    InvalidRequest,
    StartedEvent,
    UndecodableMessage,
    decode_event,
    decode_request,
)
from tests.worker_fixtures import start_worker  # noqa: F401 - fixture
from tests.chaos_fixtures import (
    FIELDS,
    IntakeHarness,
    hostile_messages,
    mutate,
    pack,
    special_messages,
    valid_request,
)

SCALE = max(1, int(os.environ.get("INFERLINE_FUZZ_SCALE", "1")))
MUTATIONS_PER_EXAMPLE = 9
REPLY = "inferline.reply.fuzz"  # under the default reply prefix
DLQ = "fuzz-dlq"
MAX_ERROR_MESSAGE = 1024  # a rejection names the field; it never echoes the input


def harness_settings(**limits) -> Settings:
    return Settings(
        kafka={"request_topic": "fuzz-requests", "dlq_topic": DLQ, "max_message_bytes": 1_048_576},
        model={"max_model_len": 256},
        limits={"max_tokens_cap": 8, "tenants": {"t1": {"requests_per_s": 5.0}}, **limits},
    )


@pytest.fixture(scope="module")
def tokenizer():
    from inferline.worker.engine.models.loader import load_tokenizer, resolve_model_dir

    return load_tokenizer(resolve_model_dir())


class Checker:
    """Feeds one message and asserts that it ends in exactly one well-formed outcome."""

    def __init__(self, tokenizer, **limits) -> None:
        from inferline.worker.engine.engine import LLMEngine, Rejected

        self.h = IntakeHarness(harness_settings(**limits))
        self.engine_self = types.SimpleNamespace(
            tokenizer=tokenizer, vocab_size=49152, max_model_len=2048
        )
        self.tokenize, self.Rejected = LLMEngine.tokenize, Rejected
        self.kinds: dict[str, int] = {}

    def check(self, value: bytes) -> str:
        redelivered = self.h.worker.delivery.num_resubmitted
        sent, added = self.h.feed(value)
        if added:
            kind = self._admitted(value, sent, added)
        elif self.h.worker.delivery.num_resubmitted == redelivered + 1:
            # the same request again: its final done exists, and is sent again as it was
            assert [decode_event(o.value).type for o in sent] in ([], ["done"]), sent
            kind = "redelivery_of_a_finished_request"
        else:
            assert len(sent) == 1, f"{len(sent)} outgoing messages for one record: {value[:200]!r}"
            kind = (
                self._dead_letter(value, sent[0])
                if sent[0].topic == DLQ
                else self._answered(sent[0])
            )
        assert self.h.settled(), f"record not finished in the offset tracker: {value[:200]!r}"
        self.h.sent.clear()
        self.h.worker.engine_loop.added.clear()
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        return kind

    def _dead_letter(self, value: bytes, out) -> str:
        headers = dict(out.headers)
        source = {"error", "source-topic", "source-partition", "source-offset"}
        assert source <= set(headers) <= source | {"truncated", "original-size"}
        if "truncated" in headers:  # too big for the dead-letter topic: the head, and its size
            assert headers["truncated"] == b"value"
            assert int(headers["original-size"]) == len(value) and value.startswith(out.value)
            assert len(out.value) < len(value)
            limit = self.h.worker.delivery.dlq_limit.bytes()
            assert batch_size(out.key, out.value, out.headers) <= limit
        else:
            assert out.value == value
        assert 0 < len(headers["error"]) <= 400
        if headers["error"].startswith(b"reply_topic "):  # decodable, but not to be answered there
            return self._refused_topic(value)
        with pytest.raises(UndecodableMessage):
            decode_request(value, 1_048_576, 256)
        return "dead_letter"

    def _refused_topic(self, value: bytes) -> str:
        from inferline.worker.intake.reply_topics import refusal

        try:
            topic = decode_request(value, 1_048_576, 256).reply_topic
        except InvalidRequest as exc:
            topic = exc.reply_topic
        assert refusal(topic, self.h.worker.settings.kafka), topic
        return "reply_topic_refused"

    def _answered(self, out) -> str:
        ev = decode_event(out.value)  # the bytes a client reads back
        assert isinstance(ev, DoneEvent) and ev.seq == 0 and out.key == ev.id.encode()
        assert ev.finish_reason in ("rejected", "timeout", "cancelled"), ev
        assert ev.error is not None and ev.error.code in ERROR_CODES
        assert 0 < len(ev.error.message) <= MAX_ERROR_MESSAGE, ev.error.message[:200]
        return f"{ev.finish_reason}:{ev.error.code}"

    def _admitted(self, value: bytes, sent, added) -> str:
        assert not sent and len(added) == 1
        req = decode_request(value, 1_048_576, 256)
        try:
            ids = self.tokenize(self.engine_self, added[0])
            assert ids and all(0 <= t < 49152 for t in ids)
        except self.Rejected:
            pass  # the engine answers it with a `rejected` done: handled
        except Exception as exc:  # anything else escapes the engine thread and kills it
            raise AssertionError(
                f"engine tokenize raised {exc!r} for an admitted request {value[:300]!r}"
            ) from exc
        events = [decode_event(o.value) for o in self.h.finish_admitted(added[0])]
        assert isinstance(events[0], StartedEvent) and isinstance(events[-1], DoneEvent)
        assert [e.seq for e in events] == list(range(len(events)))
        assert events[-1].metadata == req.metadata and events[-1].id == req.id
        return "admitted"


# ------------------------------------------------------------------------------ hypothesis

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.binary(max_size=40),
)
msgpack_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=20,
)
# A request-shaped map: the contract's fields, each either a plausible value or anything at all.
plausible = {
    "v": st.just(1),
    "id": st.from_regex(r"[A-Za-z0-9._:-]{1,20}", fullmatch=True),
    "reply_topic": st.just(REPLY),
    "prompt": st.text(min_size=1, max_size=30),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "x"]), "content": st.text(max_size=20)}
        ),
        min_size=1,
        max_size=3,
    ),
    "prompt_token_ids": st.lists(st.integers(0, 49151), min_size=1, max_size=8),
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 50),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "priority": st.integers(-5, 5),
    "tenant": st.sampled_from(["default", "t1", "t2"]),
    "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    "timeout_s": st.floats(0.001, 100),
    "created_at": st.floats(0, 2e9),
    "stream": st.booleans(),
    "seed": st.integers(-(2**63), 2**63 - 1),
}
# Mostly valid: plausible values only, one prompt field (admissions, rate limits, timeouts).
plausible_maps = st.fixed_dictionaries(
    {
        "v": st.just(1),
        "id": plausible["id"],
        "reply_topic": st.just(REPLY),
        "max_tokens": plausible["max_tokens"],
    },
    optional={
        name: plausible[name]
        for name in plausible
        if name
        not in ("v", "id", "reply_topic", "max_tokens", "prompt", "messages", "prompt_token_ids")
    },
).flatmap(
    lambda m: st.sampled_from(["prompt", "messages", "prompt_token_ids"]).flatmap(
        lambda f: plausible[f].map(lambda value: {**m, f: value})
    )
)
request_maps = st.fixed_dictionaries(
    {"v": st.just(1), "id": plausible["id"], "reply_topic": st.just(REPLY)},
    optional={
        name: plausible[name] | msgpack_values if name in plausible else msgpack_values
        for name in FIELDS
        if name not in ("v", "id", "reply_topic")
    },
)


def test_fuzz_intake_10k_messages(tokenizer):
    kinds: Counter[str] = Counter()
    count = {"messages": 0}

    @settings(
        max_examples=1000 * SCALE,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        obj=st.one_of(plausible_maps, request_maps, msgpack_values), seed=st.integers(0, 2**32 - 1)
    )
    def run(obj, seed):
        checker = Checker(tokenizer)  # a fresh worker per example: replays see the same state
        rng = random.Random(seed)
        original = data = msgpack.packb(obj, use_bin_type=True)
        checker.check(data)
        for _ in range(MUTATIONS_PER_EXAMPLE):  # mostly one mutation of the original, some chains
            data = mutate(rng, data if rng.random() < 0.25 else original)
            checker.check(data)
        count["messages"] += 1 + MUTATIONS_PER_EXAMPLE
        kinds.update(checker.kinds)

    run()
    print(f"\nfuzz: {count['messages']} messages, outcomes {sorted(kinds.items())}")
    assert count["messages"] >= 10_000 * SCALE
    # The generator reaches every outcome, or it would not be testing much.
    assert kinds["dead_letter"] > 100 and kinds["admitted"] > 100
    assert kinds["rejected:invalid_request"] > 100


def test_hostile_generator_mix(tokenizer):
    """The generator the broker test uses, offline: 2,000 messages, every one accounted for."""
    checker = Checker(tokenizer)
    for value in hostile_messages(random.Random(7), REPLY, 2_000 * SCALE):
        checker.check(value)
    assert sum(checker.kinds.values()) == 2_000 * SCALE


@pytest.mark.parametrize(
    "name,value", special_messages(REPLY), ids=lambda x: x if isinstance(x, str) else ""
)
def test_special_attacks(tokenizer, name, value):
    """A million stop strings, a million token ids, NaN, deep nesting, bad UTF-8 in every string
    field, header lengths that lie, template and role injection: each is classified, none raises."""
    checker = Checker(tokenizer)
    kind = checker.check(value)
    # What the contract says about the named ones.
    if name.startswith("bad_utf8_") and name not in ("bad_utf8_id", "bad_utf8_unknown_field"):
        assert kind == "rejected:invalid_request", (name, kind)
    if name in (
        "deep_nesting",
        "nil",
        "empty",
        "array",
        "int_keys",
        "bin_id",
        "long_id",
        "bad_topic",
        "dot_topic",
        "str_header_lies",
        "map_header_lies",
        "array_header_lies",
        "bad_utf8_id",
    ):
        assert kind == "dead_letter", (name, kind)
    if name in ("million_token_ids",):
        assert kind == "rejected:prompt_too_long"
    if name in ("ancient_created_at",):
        assert kind == "timeout:timeout"
    if name.startswith("reply_topic_"):  # valid or not, never answered on a forbidden topic
        assert kind == "reply_topic_refused", (name, kind)


def test_rate_limited_and_cancelled_paths_echo_metadata(tokenizer):
    """The triage outcomes that answer a *valid* request without running it echo its metadata."""
    checker = Checker(tokenizer)
    rng = random.Random(3)
    reqs = [
        {**valid_request(rng, REPLY), "tenant": "t1", "metadata": {"n": str(i)}} for i in range(20)
    ]
    kinds = [checker.check(pack(r)) for r in reqs]
    assert "rejected:rate_limited" in kinds and "admitted" in kinds
    checker.h.worker.cancels.add("cancel-me")
    assert (
        checker.check(pack({**reqs[0], "id": "cancel-me", "tenant": "t2"})) == "cancelled:cancelled"
    )


def make_room_in_interned_strings() -> None:
    """msgpack interns every str map key it decodes, in CPython's one table of interned strings;
    a decode that finds the table out of free slots reallocates it (MBs, kept by the interpreter,
    not by the worker). Intern throwaway keys until that happens: the table then has at least as
    many free slots as it holds strings, far more than one round of messages adds."""
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        for i in range(10_000_000):
            sys.intern(f"inferline-fuzz-{i}")  # dropped at once: it leaves a used-up slot
            if i % 1024 == 0 and tracemalloc.get_traced_memory()[0] - base > 256 * 2**10:
                return
    finally:
        tracemalloc.stop()
    raise AssertionError("the interned-string table did not reallocate")


def test_memory_stays_bounded(tokenizer):
    """tracemalloc over two rounds of hostile and oversized input: a bounded peak, and nothing
    retained from one round to the next (no per-message state survives its offset)."""
    checker = Checker(tokenizer)
    specials = [v for _, v in special_messages(REPLY)]
    msgs = hostile_messages(random.Random(11), REPLY, 1_500) + specials

    def one_round() -> None:
        for value in msgs:
            checker.check(value)

    one_round()  # warm-up: caches, metric label children, pydantic schemas
    gc.collect()
    # Else a round may reallocate that table, and it would count as retained (1 run in 4).
    make_room_in_interned_strings()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        one_round()
        gc.collect()
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    largest = max(len(v) for v in msgs)
    print(
        f"\nmemory: largest message {largest / 2**20:.2f} MiB, "
        f"peak {(peak - base) / 2**20:.1f} MiB, "
        f"retained {(current - base) / 2**10:.1f} KiB over {len(msgs)} messages"
    )
    # A 1 MiB message may unpack to a few tens of MB (a million small ints); never more.
    assert peak - base < 96 * 2**20
    assert current - base < 2 * 2**20  # per-message state does not accumulate


# ------------------------------------------------------------------------------ a live worker


def test_tenant_attacks_in_topic_tenancy():
    """INFERLINE_KAFKA__TENANCY=topic, records on acme's request topic: whatever the body says
    (another tenant, another tenant's reply topic, hostile bytes), the worker answers only under
    acme's reply prefix or dead-letters, and everything it runs runs as acme."""
    from aiokafka import TopicPartition

    from tests.chaos_fixtures import IntakeHarness, assign

    h = IntakeHarness(
        Settings(
            kafka={"request_topic": "fuzz-requests", "dlq_topic": DLQ, "tenancy": "topic"},
            model={"max_model_len": 256},
            limits={"max_tokens_cap": 8},
        )
    )
    h.tp = TopicPartition("fuzz-requests.acme", 0)
    assign(h.worker.intake, [h.tp])
    rng, mine, theirs = random.Random(5), "inferline.reply.acme.fuzz", "inferline.reply.globex.fuzz"
    attacks = [
        pack({**valid_request(rng, mine), "tenant": "globex"}),
        pack(valid_request(rng, theirs)),
        pack({**valid_request(rng, theirs), "tenant": "globex"}),
        pack(valid_request(rng, "fuzz-requests.globex")),
        pack({**valid_request(rng, mine), "priority": -1000}),
    ]
    outcomes = set()
    for value in hostile_messages(rng, mine, 400 * SCALE) + attacks:
        sent, added = h.feed(value)
        for out in sent:
            assert out.topic == DLQ or out.topic.startswith("inferline.reply.acme."), out.topic
            outcomes.add("dead_letter" if out.topic == DLQ else "answered")
        for req in added:
            job = h.worker.jobs[req.request_id]
            assert job.request.tenant == "acme"
            outcomes.add("admitted")
    assert outcomes == {"dead_letter", "answered", "admitted"}


def test_fuzz_priorities_and_sample_counts():
    """Hostile `priority` and `n` (issue 38), any int or not an int at all: each request is
    rejected naming its field, or admitted with its priority inside the default range [0, 1000]
    (no producer outranks the default class) and n x max_tokens within the request bound."""
    h = IntakeHarness(Settings())
    limits = h.worker.settings.limits
    ints = (
        st.integers(-(2**63), 2**64 - 1)
        | st.integers(-2000, 2000)
        | st.sampled_from([0, 1, 16, 17, -1])
    )
    outcomes: Counter[str] = Counter()

    @settings(max_examples=600 * SCALE, deadline=None, database=None)
    @given(
        priority=ints | st.floats() | st.none() | st.text(max_size=3),
        n=ints | st.floats(),
        max_tokens=st.integers(1, 5000),
    )
    def run(priority, n, max_tokens):
        req = {
            "v": 1,
            "id": f"pn-{h.offset}",
            "reply_topic": REPLY,
            "prompt": "Hi.",
            "max_tokens": max_tokens,
            "priority": priority,
            "n": n,
        }
        sent, added = h.feed(msgpack.packb(req, use_bin_type=True))
        if added:
            (engine_req,) = added
            assert limits.min_priority <= engine_req.priority <= limits.max_priority
            assert (
                engine_req.sampling.n * engine_req.sampling.max_tokens <= limits.max_request_tokens
            )
            outcomes["admitted"] += 1
            return
        (done,) = sent
        error = msgpack.unpackb(done.value)["error"]
        assert error["code"] == "invalid_request" and error["message"].split(".")[0].split(":")[
            0
        ] in ("priority", "n", "max_tokens"), error
        outcomes["rejected"] += 1

    run()
    assert outcomes["admitted"] > 20 and outcomes["rejected"] > 20, outcomes
