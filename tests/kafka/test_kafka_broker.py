"""The local broker and the Kafka fixtures, against the real broker."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from tests.kafka_fixtures import (
    KAFKA_SH,
    LOCAL_BOOTSTRAP,
    consume_until,
    free_port_pair,
    produce_raw,
)

pytestmark = pytest.mark.kafka


async def test_produce_consume_roundtrip(kafka_bootstrap, new_topic):
    topic = await new_topic()
    values = [f"message {i}".encode() for i in range(20)] + [b"", bytes(range(256))]
    acks = await produce_raw(kafka_bootstrap, topic, values, key=b"k", headers=[("h", b"v")])
    assert [a.offset for a in acks] == list(range(len(values)))

    records = await consume_until(kafka_bootstrap, topic)
    assert [r.value for r in records] == values
    assert {r.key for r in records} == {b"k"}
    assert records[0].headers == (("h", b"v"),)


async def test_topic_with_partitions(kafka_bootstrap, new_topic):
    topic = await new_topic(partitions=5)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
    finally:
        await admin.close()
    assert sorted(p["partition"] for p in described["partitions"]) == [0, 1, 2, 3, 4]

    for p in range(5):
        await produce_raw(kafka_bootstrap, topic, [f"p{p}".encode()], partition=p)
    records = await consume_until(kafka_bootstrap, topic, lambda rs: len(rs) >= 5)
    assert sorted((r.partition, r.value) for r in records) == [
        (p, f"p{p}".encode()) for p in range(5)
    ]


async def test_consume_until_waits_for_a_topic_and_times_out(kafka_bootstrap, new_topic):
    topic = await new_topic(partitions=2)
    await produce_raw(kafka_bootstrap, topic, [(b"a", b"1"), (b"b", b"2")])
    records = await consume_until(
        kafka_bootstrap, topic, lambda rs: any(r.value == b"2" for r in rs)
    )
    assert b"2" in [r.value for r in records]

    with pytest.raises(TimeoutError, match="condition not met"):
        await consume_until(kafka_bootstrap, topic, lambda rs: len(rs) > 2, timeout=0.5)
    got = await consume_until(
        kafka_bootstrap, topic, lambda rs: False, timeout=0.3, raise_on_timeout=False
    )
    assert len(got) == 2


def run_kafka_sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(KAFKA_SH), *args], capture_output=True, text=True, timeout=120)


def pid_file() -> Path:
    kdir = os.environ.get("INFERLINE_KAFKA_DIR", str(KAFKA_SH.parent.parent / ".kafka"))
    return Path(kdir) / "kafka.pid"


@pytest.mark.skipif(
    os.environ.get("INFERLINE_KAFKA__BOOTSTRAP_SERVERS", "localhost:9092") not in LOCAL_BOOTSTRAP,
    reason="an external broker is configured: scripts/kafka.sh manages only the local one",
)
def test_start_twice_reuses_the_running_broker(kafka_bootstrap):
    before = pid_file().read_text().strip() if pid_file().exists() else None
    for _ in range(2):
        done = run_kafka_sh("start")
        assert done.returncode == 0, done.stderr
        assert "reusing it" in done.stderr
        assert done.stdout.strip() == run_kafka_sh("logs-path").stdout.strip()
    if before is not None:  # this session's broker is ours: same process as before
        assert pid_file().read_text().strip() == before


def test_start_survives_a_stale_pid_file(kafka_bootstrap):
    if not pid_file().exists():
        pytest.skip("the broker on localhost:9092 was not started by scripts/kafka.sh")
    real_pid = pid_file().read_text().strip()
    # A live process that is not the broker: the pid of a recycled pid file.
    pid_file().write_text(f"{os.getpid()}\n")
    done = run_kafka_sh("start")
    assert done.returncode == 0, done.stderr
    assert pid_file().read_text().strip() == real_pid


def test_external_broker_is_left_alone():
    env = dict(os.environ, INFERLINE_KAFKA__BOOTSTRAP_SERVERS="broker.invalid:9092")
    done = subprocess.run(
        [str(KAFKA_SH), "start"], capture_output=True, text=True, env=env, timeout=30
    )
    assert done.returncode == 0
    assert "not starting a local one" in done.stderr


def running(pid: str) -> bool:
    """Alive, not a zombie (an orphan's zombie lingers where pid 1 does not reap)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


@pytest.mark.slow
async def test_private_broker_restart_keeps_data_and_survives_a_lost_pid_file(tmp_path):
    """A second broker (own port and folder), so that stopping it disturbs no other test."""
    port = free_port_pair()
    bootstrap = f"localhost:{port}"
    env = dict(
        os.environ,
        INFERLINE_KAFKA_PORT=str(port),
        INFERLINE_KAFKA_DIR=str(tmp_path / "kafka"),
        INFERLINE_KAFKA__BOOTSTRAP_SERVERS=bootstrap,
        INFERLINE_KAFKA_HEAP="-Xmx256m -Xms128m",
    )

    def kafka_sh(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [str(KAFKA_SH), *args], capture_output=True, text=True, env=env, timeout=300
        )
        assert done.returncode == 0, done.stderr
        return done

    pid = None
    try:
        log = Path(kafka_sh("start").stdout.strip())
        assert log.exists() and "Kafka Server started" in log.read_text()
        admin = AIOKafkaAdminClient(
            bootstrap_servers=bootstrap
        )  # the broker creates no topic by itself
        await admin.start()
        try:
            await admin.create_topics([NewTopic("kept", 1, 1)])
        finally:
            await admin.close()
        await produce_raw(bootstrap, "kept", [b"before restart"])

        kafka_sh("restart")
        await produce_raw(bootstrap, "kept", [b"after restart"])
        records = await consume_until(bootstrap, "kept", lambda rs: len(rs) >= 2, timeout=30)
        assert [r.value for r in records] == [b"before restart", b"after restart"]

        pid_path = tmp_path / "kafka" / "kafka.pid"
        pid = pid_path.read_text().strip()
        pid_path.unlink()  # a lost pid file: the running broker is found again, not started twice
        assert "reusing it" in kafka_sh("start").stderr
        assert pid_path.read_text().strip() == pid
    finally:
        kafka_sh("stop")
    assert subprocess.run([str(KAFKA_SH), "status"], env=env, capture_output=True).returncode == 3
    assert pid and not running(pid)
