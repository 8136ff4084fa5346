"""Security on the wire: SASL (SCRAM-SHA-512) over TLS, on a broker of the test's own that only
speaks SASL_SSL (scripts/kafka/sasl_ssl.sh, certificates from scripts/gen_test_certs.sh, SCRAM
users created at format time) on a free port:

- clients without credentials, with a wrong password, without TLS, or not trusting the broker's
  CA are refused; one with the credentials produces and consumes. The clients are built by the
  project's own option builders (KafkaSettings.client_options, KafkaSettings.connection_options)
  from a Settings tree, so the path tested is the one the worker and the client use.
- `python -m inferline.worker` configured only through INFERLINE_KAFKA__* (password from the
  environment) serves a request sent by InferenceClient over SASL_SSL, and its logs (DEBUG) never
  contain the password.

The offline checks (secrets out of errors, no code from requests): tests/unit/test_security.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from inferline.config.settings import Settings
from tests.kafka_fixtures import free_port_pair
from tests.unit.test_security import REPO  # noqa: F401


SASL_SH = REPO / "scripts" / "kafka" / "sasl_ssl.sh"


class SaslBroker:
    def __init__(self, kdir: Path) -> None:
        self.port = free_port_pair()
        self.kdir = kdir
        self.bootstrap = f"localhost:{self.port}"
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("INFERLINE_KAFKA")},
            "INFERLINE_KAFKA_PORT": str(self.port),
            "INFERLINE_KAFKA_DIR": str(kdir),
        }

    def sh(self, cmd: str) -> None:
        done = subprocess.run(
            [str(SASL_SH), cmd], env=self.env, capture_output=True, text=True, timeout=240
        )
        if done.returncode != 0:
            raise RuntimeError(f"sasl_ssl.sh {cmd} failed:\n{done.stderr[-3000:]}")

    @property
    def password(self) -> str:
        return (self.kdir / "secrets" / "inferline.password").read_text().strip()

    @property
    def cafile(self) -> Path:
        return self.kdir / "certs" / "ca.pem"

    def kafka(self, **overrides) -> dict:
        """The `kafka` settings of an authenticated client of this broker."""
        return {
            "bootstrap_servers": self.bootstrap,
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_username": "inferline",
            "sasl_password": self.password,
            "ssl_cafile": str(self.cafile),
            **overrides,
        }


def running(broker: SaslBroker):
    """A module fixture's body: the broker started, yielded, stopped."""
    broker.sh("start")
    try:
        yield broker
    finally:
        broker.sh("stop")


@pytest.fixture(scope="module")
def sasl_broker(tmp_path_factory):
    yield from running(SaslBroker(tmp_path_factory.mktemp("kafka-sasl")))


def worker_kwargs(kafka: dict) -> dict:

    return Settings(kafka=kafka).kafka.client_options()


async def round_trip(kwargs: dict, topic: str, timeout: float = 20.0) -> bytes:
    """Produce one record and read it back with the given connection options."""
    producer = AIOKafkaProducer(**kwargs, request_timeout_ms=8000, enable_idempotence=True)
    consumer = None
    try:
        await asyncio.wait_for(producer.start(), timeout)
        value = uuid.uuid4().hex.encode()
        meta = await asyncio.wait_for(producer.send_and_wait(topic, value), timeout)
        consumer = AIOKafkaConsumer(
            **kwargs, group_id=None, enable_auto_commit=False, request_timeout_ms=8000
        )
        await asyncio.wait_for(consumer.start(), timeout)
        tp = TopicPartition(topic, meta.partition)
        consumer.assign([tp])
        consumer.seek(tp, meta.offset)
        record = await asyncio.wait_for(consumer.getone(), timeout)
        assert record.value == value
        return record.value
    finally:
        for client in (producer, consumer):
            if client is not None:
                try:
                    await asyncio.wait_for(client.stop(), 10)
                except Exception:  # noqa: BLE001 - a refused client may not stop cleanly
                    pass


async def refused(kwargs: dict, topic: str) -> str:
    try:
        await round_trip(kwargs, topic, timeout=15.0)
    except Exception as exc:  # noqa: BLE001 - any refusal will do; which one is reported
        return type(exc).__name__
    raise AssertionError(f"a client with {sorted(kwargs)} was let in")


@pytest.mark.kafka
async def test_sasl_ssl_refuses_strangers_and_admits_the_credentialed(sasl_broker):
    topic = f"sec-{uuid.uuid4().hex[:8]}"
    ok = worker_kwargs(sasl_broker.kafka())
    assert ok["security_protocol"] == "SASL_SSL" and ok["sasl_mechanism"] == "SCRAM-SHA-512"
    admin = AIOKafkaAdminClient(**ok)  # the broker creates no topic by itself
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        await admin.close()
    assert await round_trip(ok, topic)

    # The producer client's own option builder, same settings, same result.

    assert await round_trip(Settings(kafka=sasl_broker.kafka()).kafka.connection_options(), topic)

    outcomes = {
        "no credentials (TLS only)": await refused(
            worker_kwargs(
                sasl_broker.kafka(
                    security_protocol="SSL",
                    sasl_mechanism=None,
                    sasl_username=None,
                    sasl_password=None,
                )
            ),
            topic,
        ),
        "wrong password": await refused(
            worker_kwargs(sasl_broker.kafka(sasl_password="not-the-password")), topic
        ),
        "unknown user": await refused(
            worker_kwargs(sasl_broker.kafka(sasl_username="mallory")), topic
        ),
        "plaintext": await refused({"bootstrap_servers": sasl_broker.bootstrap}, topic),
        "untrusted CA": await refused(
            worker_kwargs(
                sasl_broker.kafka(ssl_cafile=str(sasl_broker.kdir / "certs" / "other-ca.pem"))
            ),
            topic,
        ),
    }
    print(f"\nrefused: {outcomes}")


@pytest.mark.kafka
@pytest.mark.slow
async def test_worker_serves_over_sasl_ssl_and_never_logs_the_secret(sasl_broker, tmp_path):
    from inferline.producer.client import InferenceClient
    from tests.worker_fixtures import Topics, spawn_worker, wait_log

    settings = Settings(kafka=sasl_broker.kafka())
    admin = AIOKafkaAdminClient(**worker_kwargs(sasl_broker.kafka()))
    await admin.start()
    stem = uuid.uuid4().hex[:8]
    topics = Topics(
        requests=f"sec-req-{stem}",
        cancel=f"sec-cancel-{stem}",
        dlq=f"sec-dlq-{stem}",
        replies=f"inferline.reply.sec-{stem}",
    )
    try:
        await admin.create_topics(
            [
                NewTopic(t, 1, 1)
                for t in (topics.requests, topics.cancel, topics.dlq, topics.replies)
            ]
        )
    finally:
        await admin.close()

    log = tmp_path / "worker.log"
    # Everything, the password included, reaches the worker through INFERLINE_* variables only.
    proc = spawn_worker(
        sasl_broker.bootstrap,
        topics,
        log,
        kafka=sasl_broker.kafka(),
        log={"level": "DEBUG"},
        model={"max_model_len": 128},
    )
    try:
        await wait_log(log, "intake.assigned", proc, timeout=180)
        client = InferenceClient(
            settings=settings,
            reply_topic=topics.replies,
            request_topic=topics.requests,
            cancel_topic=topics.cancel,
            timeout_s=120,
        )
        async with client:
            handle = await client.submit("Say hi.", max_tokens=2, temperature=0.0)
            result = await handle.result()
        assert result.finish_reason in ("length", "stop") and result.usage.completion_tokens >= 1
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(asyncio.to_thread(proc.wait), 90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text(errors="replace")
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert any(line.get("event") == "worker.started" for line in lines)
    for secret in (
        sasl_broker.password,
        (sasl_broker.kdir / "certs" / "keystore.password").read_text().strip(),
    ):
        assert secret not in text, "a secret reached the worker's log"
