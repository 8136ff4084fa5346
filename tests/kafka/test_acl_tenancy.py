"""Topic tenancy under Kafka's ACLs: the operator recipe of docs/security.md on a SASL_SSL broker
with KRaft's StandardAuthorizer (scripts/kafka/sasl_ssl.sh, INFERLINE_KAFKA_AUTHORIZER=1).

Users: `inferline` (the worker), tenants `acme` and `globex`, `admin` (super user, sets the ACLs
through confluent-kafka's admin client: aiokafka has no ACL API). Each tenant may write only its
own request and cancel topic and read only its own reply prefix; the worker reads every tenant's
topics and writes under the reply prefix. Then: globex cannot produce to acme's request topic nor
read acme's replies, and the worker still serves acme.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import msgpack
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from tests.kafka_fixtures import create_named_topics

from tests.kafka.test_security import SaslBroker, running, worker_kwargs
from inferline.config.settings import KafkaSettings, Settings
from inferline.producer import acls
from inferline.contract.schema import decode_event
from tests.worker_fixtures import (
    Topics,
    check_attempts,
    final_done,
    request,
    wait_ready,
    worker_config,
)
from inferline.worker.app import Worker, engine_settings
from inferline.worker.engine.engine import LLMEngine

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
confluent_admin = pytest.importorskip("confluent_kafka.admin")

STEM = uuid.uuid4().hex[:6]
REQ, CANCEL, DLQ = f"acl-req-{STEM}", f"acl-cancel-{STEM}", f"acl-dlq-{STEM}"
REPLY = "inferline.reply."


class AclBroker(SaslBroker):
    def __init__(self, kdir) -> None:
        super().__init__(kdir)
        self.env.update(
            INFERLINE_KAFKA_AUTHORIZER="1", INFERLINE_KAFKA_SASL_EXTRA_USERS="acme globex initech"
        )

    def secret(self, user: str) -> str:
        return (self.kdir / "secrets" / f"{user}.password").read_text().strip()

    def client(self, user: str) -> dict:
        """aiokafka options of `user`."""
        return worker_kwargs(self.kafka(sasl_username=user, sasl_password=self.secret(user)))

    def settings(self, user: str) -> KafkaSettings:
        return KafkaSettings(**self.kafka(sasl_username=user, sasl_password=self.secret(user)))


def recipe(group: str) -> list:
    """docs/security.md's rules, as `inferline topics acls` makes them (producer/acls.py)."""
    kafka = KafkaSettings(request_topic=REQ, cancel_topic=CANCEL, dlq_topic=DLQ, group_id=group)
    return acls.recipe(kafka, "User:inferline", ["acme", "globex"])


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory):
    yield from running(AclBroker(tmp_path_factory.mktemp("kafka-acl")))


async def set_up(broker: AclBroker, group: str, topics: list[str], rules=None) -> None:
    admin = AIOKafkaAdminClient(**broker.client("admin"))
    await admin.start()
    try:
        existing = set(await admin.list_topics())  # the module's tests share the worker topics
    finally:
        await admin.close()
    missing = {t: 1 for t in topics if t not in existing}
    await create_named_topics(missing, **broker.client("admin"))
    rules = rules or recipe(group)
    await acls.apply(broker.settings("admin"), rules)  # what `inferline topics acls --apply` does
    # The authorizer learns ACLs from the metadata log: wait until it answers with all of them.
    admin_client = confluent_admin.AdminClient(broker.settings("admin").librdkafka_config())
    everything = confluent_admin.AclBindingFilter(
        confluent_admin.ResourceType.ANY,
        None,
        confluent_admin.ResourcePatternType.ANY,
        None,
        None,
        confluent_admin.AclOperation.ANY,
        confluent_admin.AclPermissionType.ANY,
    )
    for _ in range(60):
        if len(await asyncio.to_thread(admin_client.describe_acls(everything).result, 30)) >= len(
            rules
        ):
            break
        await asyncio.sleep(0.5)


@contextlib.asynccontextmanager
async def serving(broker: AclBroker, group: str, replies: str, model_runner):
    """A worker as `inferline`, with only the recipe's rights, in topic tenancy."""
    kafka = {
        **broker.kafka(),
        "request_topic": REQ,
        "cancel_topic": CANCEL,
        "dlq_topic": DLQ,
        "group_id": group,
        "tenancy": "topic",
    }
    settings = Settings(
        **worker_config(broker.bootstrap, Topics(REQ, CANCEL, DLQ, replies), kafka=kafka)
    )
    worker = Worker(settings, LLMEngine(model_runner, engine_settings(settings)))
    task = asyncio.create_task(worker.run())
    try:
        await wait_ready(worker, task, timeout=120)
        yield worker
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 60)


async def produce(kwargs: dict, topic: str, value: bytes, key: bytes) -> None:
    producer = AIOKafkaProducer(**kwargs, request_timeout_ms=8000)
    await producer.start()
    try:
        await asyncio.wait_for(producer.send_and_wait(topic, value, key=key), 20)
    finally:
        await producer.stop()


async def read(kwargs: dict, topic: str, enough, timeout: float = 120) -> list:
    """The topic's records from the beginning, until enough(records) or the timeout."""
    consumer = AIOKafkaConsumer(
        **kwargs, group_id=None, enable_auto_commit=False, request_timeout_ms=8000
    )
    await consumer.start()
    records: list = []
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        deadline = asyncio.get_running_loop().time() + timeout
        while not enough(records) and asyncio.get_running_loop().time() < deadline:
            batch = await consumer.getmany(tp, timeout_ms=500)
            records += batch.get(tp, [])
    finally:
        await consumer.stop()
    return records


async def test_each_tenant_reaches_only_its_own_topics_and_the_worker_serves_them(
    acl_broker, model_runner
):
    group = f"acl-workers-{STEM}"
    acme_replies, globex_replies = f"{REPLY}acme.c-{STEM}", f"{REPLY}globex.c-{STEM}"
    await set_up(
        acl_broker,
        group,
        [
            REQ,
            CANCEL,
            DLQ,
            f"{REQ}.acme",
            f"{REQ}.globex",
            f"{CANCEL}.acme",
            f"{CANCEL}.globex",
            acme_replies,
            globex_replies,
        ],
    )
    acme, globex = acl_broker.client("acme"), acl_broker.client("globex")
    # The worker, as `inferline` with only the recipe's rights, serves acme in topic tenancy.
    async with serving(acl_broker, group, acme_replies, model_runner):
        req = request(acme_replies, max_tokens=3)
        await produce(acme, f"{REQ}.acme", msgpack.packb(req), req["id"].encode())
        records = await read(
            acme, acme_replies, lambda rs: any(decode_event(r.value).type == "done" for r in rs)
        )
    events = [decode_event(r.value) for r in records]
    check_attempts(events)
    assert final_done(events).finish_reason == "length"

    # Kafka itself keeps globex off acme's topics: its request topic and its replies (which now
    # hold events).
    with pytest.raises(Exception, match="TopicAuthorizationFailed"):
        await produce(globex, f"{REQ}.acme", msgpack.packb(request(acme_replies)), b"k")
    try:
        stolen = await read(globex, acme_replies, bool, timeout=10)
    except Exception as exc:  # noqa: BLE001 - refused outright
        assert "TopicAuthorizationFailed" in repr(exc), repr(exc)
    else:
        assert stolen == []
    with pytest.raises(Exception, match="TopicAuthorizationFailed"):
        await produce(globex, f"{CANCEL}.acme", msgpack.packb({"v": 1, "id": req["id"]}), b"k")


async def test_a_tenant_without_create_or_delete_runs_the_client_on_reply_topics_made_ahead(
    acl_broker, model_runner
):
    """#51: the recipe for clients that make no topics (create_reply_topics false) grants no
    CREATE; the Python client then runs on a reply topic the admin made ahead, and deletes
    nothing on close."""
    from inferline.producer.client import InferenceClient
    from inferline.producer.topics import create_topics

    group, replies = f"acl-ahead-{STEM}", f"{REPLY}initech.app-{STEM}"
    ahead = KafkaSettings(
        request_topic=REQ,
        cancel_topic=CANCEL,
        dlq_topic=DLQ,
        group_id=group,
        create_reply_topics=False,
    )
    rules = acls.recipe(ahead, "User:inferline", ["initech"])
    assert {r.operation for r in rules if r.principal == "User:initech"} == {"READ", "WRITE"}
    tenant_topics = [f"{REQ}.initech", f"{CANCEL}.initech", replies]
    await set_up(acl_broker, group, [REQ, CANCEL, DLQ, *tenant_topics], rules)
    initech = {
        **acl_broker.kafka(sasl_username="initech", sasl_password=acl_broker.secret("initech")),
        "create_reply_topics": False,
    }
    client = InferenceClient(
        request_topic=f"{REQ}.initech",
        cancel_topic=f"{CANCEL}.initech",
        reply_topic=replies,
        settings=Settings(kafka=initech),
    )
    async with serving(acl_broker, group, replies, model_runner):
        async with client:
            handle = await client.submit("Say hi.", max_tokens=3)
            result = await asyncio.wait_for(handle.result(), 120)
    assert result.finish_reason == "length"
    admin = AIOKafkaAdminClient(**acl_broker.client("admin"))
    await admin.start()
    try:
        assert replies in await admin.list_topics()  # the client deleted nothing
        refused = AIOKafkaAdminClient(**acl_broker.client("initech"))
        await refused.start()
        try:  # and could not have made it
            with pytest.raises(RuntimeError, match="error 29"):  # TOPIC_AUTHORIZATION_FAILED
                topic = f"{REPLY}initech.other-{STEM}"
                await create_topics(refused, [(topic, 1)], replication_factor=1)
        finally:
            await refused.close()
    finally:
        await admin.close()
