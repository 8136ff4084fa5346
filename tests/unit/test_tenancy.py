"""Topic tenancy (worker/service/tenancy.py, INFERLINE_KAFKA__TENANCY=topic): the tenant is the
request topic's, never the body's. Offline through the intake harness; on the broker:
tests/kafka/test_tenancy.py."""

from __future__ import annotations

import uuid

import msgpack
from aiokafka import TopicPartition

from inferline.config.settings import KafkaSettings, Settings
from tests.chaos_fixtures import IntakeHarness, assign
from tests.worker_fixtures import (  # noqa: F401 - fixtures
    check_attempts,
    collect,
    final_done,
    request,
    start_worker,
    submit,
    topics,
)
from inferline.worker.intake.reply_topics import refusal
from inferline.worker.service.tenancy import clamp_priority, tenant_of, tenant_pattern

TOPIC_MODE = KafkaSettings(
    request_topic="reqs", cancel_topic="cancels", dlq_topic="reqs.dlq", tenancy="topic"
)


def test_tenant_topics_and_the_pattern():
    import re

    pattern = re.compile(tenant_pattern("reqs", ("reqs.dlq", "cancels")))
    assert pattern.match("reqs.acme") and pattern.match("reqs.a-b_9")
    assert (
        not pattern.match("reqs.dlq")
        and not pattern.match("reqs")
        and not pattern.match("reqs.a.b")
    )
    assert not pattern.match("reqsX.acme") and not pattern.match("xreqs.acme")
    assert tenant_of("reqs.acme", "reqs") == "acme" and tenant_of("reqs.a.b", "reqs") is None
    assert tenant_of("other.acme", "reqs") is None


def test_replies_only_under_the_tenants_own_prefix():
    assert refusal("inferline.reply.acme.c1", TOPIC_MODE, "acme") is None
    assert "inferline.reply.acme." in refusal("inferline.reply.globex.c1", TOPIC_MODE, "acme")
    assert "inferline.reply.acme." in refusal("inferline.reply.acmeX.c1", TOPIC_MODE, "acme")
    assert "own topics" in refusal("reqs.globex", TOPIC_MODE, "acme")
    assert "own topics" in refusal("cancels.acme", TOPIC_MODE, "acme")


def test_priority_clamp():
    limits = Settings(limits={"tenants": {"t": {"min_priority": 0, "max_priority": 5}}}).limits
    assert [clamp_priority(p, limits, "t") for p in (-1000, 0, 3, 5, 1000)] == [0, 0, 3, 5, 5]
    # By default no producer outranks the default class (0); an operator opens lower values.
    assert clamp_priority(-7, Settings().limits, "anyone") == 0
    assert clamp_priority(7, Settings().limits, "anyone") == 7
    opened = Settings(
        limits={"tenants": {"ops": {"min_priority": -100}}, "default_tenant": {"min_priority": -3}}
    ).limits
    assert (
        clamp_priority(-1000, opened, "ops") == -100
        and clamp_priority(-1000, opened, "other") == -3
    )
    assert clamp_priority(-1000, Settings(limits={"min_priority": -10}).limits, "x") == -10


def test_priority_range_settings_are_checked():
    import pytest

    from inferline.config.settings import SettingsError, load_settings

    with pytest.raises(SettingsError):
        load_settings(limits={"tenants": {"t": {"min_priority": 5, "max_priority": 0}}})
    with pytest.raises(SettingsError):
        load_settings(limits={"min_priority": -5000})


def test_body_tenancy_clamps_priority_by_default():
    """Body tenancy (the default) trusts the body's tenant, not its priority: -1000 runs as 0."""
    h = IntakeHarness(Settings())
    _, (admitted,) = h.feed(
        msgpack.packb(
            {
                "v": 1,
                "id": "p-1",
                "reply_topic": "inferline.reply.c",
                "prompt": "Hi.",
                "max_tokens": 2,
                "priority": -1000,
            }
        )
    )
    assert admitted.priority == 0
    _, (admitted,) = h.feed(
        msgpack.packb(
            {
                "v": 1,
                "id": "p-2",
                "reply_topic": "inferline.reply.c",
                "prompt": "Hi.",
                "max_tokens": 2,
                "priority": 9,
            }
        )
    )
    assert admitted.priority == 9  # lowering one's own priority is always allowed


def harness(**limits) -> tuple[IntakeHarness, TopicPartition]:
    settings = Settings(
        kafka={
            "request_topic": "reqs",
            "cancel_topic": "cancels",
            "dlq_topic": "reqs.dlq",
            "tenancy": "topic",
        },
        limits=limits,
    )
    h = IntakeHarness(settings)
    h.tp = TopicPartition("reqs.globex", 0)
    assign(h.worker.intake, [h.tp])
    return h, h.tp


def body(**fields) -> bytes:
    return msgpack.packb(
        {
            "v": 1,
            "id": f"r-{uuid.uuid4().hex[:8]}",
            "reply_topic": "inferline.reply.globex.c",
            "prompt": "Hi.",
            "max_tokens": 2,
            **fields,
        }
    )


def test_the_topic_names_the_tenant_and_a_body_that_disagrees_is_rejected():
    h, _ = harness(tenants={"globex": {"min_priority": 0}})
    _, (admitted,) = h.feed(body())
    assert h.worker.jobs[admitted.request_id].request.tenant == "globex"
    _, (admitted,) = h.feed(body(tenant="globex", priority=-1000))
    assert admitted.priority == 0  # clamped into globex's range
    _, (admitted,) = h.feed(body(tenant="default"))  # what clients send unasked: no claim
    assert h.worker.jobs[admitted.request_id].request.tenant == "globex"
    (reply,), added = h.feed(body(tenant="acme"))
    assert not added and reply.topic == "inferline.reply.globex.c"
    assert msgpack.unpackb(reply.value)["error"]["message"].startswith("tenant:")
    (dead,), added = h.feed(body(reply_topic="inferline.reply.acme.c"))  # another tenant's replies
    assert (
        not added
        and dead.topic == "reqs.dlq"
        and b"inferline.reply.globex." in dict(dead.headers)["error"]
    )


def test_a_cancel_counts_only_for_its_own_tenant():
    h, _ = harness()
    _, (admitted,) = h.feed(body(id="shared-id"))
    h.worker.requests.cancel("shared-id", tenant="acme")  # another tenant's cancel topic
    assert h.worker.engine_loop.aborted == []
    h.worker.requests.cancel("shared-id", tenant="globex")
    assert h.worker.engine_loop.aborted == [(admitted.request_id, "cancelled")]
    h.worker.requests.cancel(
        "early", tenant="acme"
    )  # read before its request: remembered per tenant
    sent, added = h.feed(body(id="early"))
    assert added and not sent  # globex's "early" runs
    h.worker.requests.cancel("early2", tenant="globex")
    (reply,), added = h.feed(body(id="early2"))
    assert not added and msgpack.unpackb(reply.value)["finish_reason"] == "cancelled"


RESERVED_CASES = [
    "dlq",
    "DLQ",
    "Dlq",
    "cancel",
    "requests",
    "llm",
    "default",
    "reply",
    "inferline",
    "_x",
    "__c",
    "changelog",
    "retry",
]


def test_tenant_names_that_name_internal_topics_are_refused():
    """A tenant named like an internal topic or suffix (issue 38): `dlq` would own
    `llm.requests.dlq`, the dead-letter topic, and `inferline topics acls` would grant it write
    there."""
    from inferline.contract.topics import tenant_problem

    kafka = KafkaSettings()
    for name in RESERVED_CASES:
        assert tenant_problem(name, kafka), name
    for name in ("acme", "globex-2", "a_b", "dlq2", "my-cancel"):
        assert tenant_problem(name, kafka) is None, name
    assert "1-64" in tenant_problem("a.b", kafka)
    # A deployment's own names count, and '.' versus '_' collisions too.
    custom = KafkaSettings(request_topic="jobs", cancel_topic="stop", dlq_topic="jobs.quarantine")
    assert tenant_problem("quarantine", custom) and tenant_problem("stop", custom)
    assert tenant_problem("parked", KafkaSettings(request_topic="jobs", dlq_topic="jobs_parked"))


def test_the_worker_never_takes_a_reserved_tenant_topic():
    import re

    pattern = re.compile(
        tenant_pattern("llm.requests", ("llm.requests.dlq", "llm.cancel", "inferline.reply."))
    )
    for name in [n for n in RESERVED_CASES if n != "inferline"]:
        assert (
            not pattern.match(f"llm.requests.{name}")
            and tenant_of(f"llm.requests.{name}", "llm.requests") is None
        )
    assert not pattern.match("llm.requests.inferline")  # a word of the reply prefix
    assert (
        pattern.match("llm.requests.acme")
        and tenant_of("llm.requests.acme", "llm.requests") == "acme"
    )
    # Such a topic is still never a reply topic.
    assert "own topics" in refusal(
        "llm.requests.default", KafkaSettings(tenancy="topic", reply_topic_prefix="")
    )


def test_the_gateway_refuses_keys_of_reserved_tenants():
    import pytest

    from inferline.config.settings import GatewaySettings
    from inferline.producer.gateway.auth import load_keys

    with pytest.raises(SystemExit, match="reserved"):
        load_keys(GatewaySettings(api_keys={"k": "dlq"}), topic_tenancy=True, kafka=KafkaSettings())
    assert load_keys(
        GatewaySettings(api_keys={"k": "acme"}), topic_tenancy=True, kafka=KafkaSettings()
    ) == {"k": "acme"}
