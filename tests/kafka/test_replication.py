"""Replication (issue 51): a 3-node KRaft cluster of scripts/kafka.sh (INFERLINE_KAFKA_VOTERS,
three processes on localhost, every node broker and controller). The topics inferline creates
take the cluster's defaults, 3 replicas and min.insync.replicas 2, instead of the 1 they were
made with; and with one node SIGKILLed mid-stream, the stream ends and the next request is
answered, through the worker's transactions and the client's reply topic.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from inferline.config.settings import Settings
from inferline.producer.client import InferenceClient
from inferline.producer.topics import create_topics
from inferline.worker.app import Worker, engine_settings
from inferline.worker.engine.engine import LLMEngine
from tests.chaos_fixtures import KAFKA_SH
from tests.kafka_fixtures import free_port_pair
from tests.worker_fixtures import Topics, wait_ready, worker_config

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
NODES = 3


class Cluster:
    """NODES nodes of one static quorum, each a kafka.sh broker in a directory of its own."""

    def __init__(self, root: Path) -> None:
        self.ports = [free_port_pair() for _ in range(NODES)]
        voters = ",".join(f"{i + 1}@localhost:{p + 1}" for i, p in enumerate(self.ports))
        cluster_id = subprocess.run(
            [
                "python3",
                "-c",
                "import base64,uuid;print(base64.urlsafe_b64encode("
                "uuid.uuid4().bytes).decode().rstrip('='))",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        base = {k: v for k, v in os.environ.items() if not k.startswith("INFERLINE_KAFKA")}
        self.envs = [
            {
                **base,
                "INFERLINE_KAFKA_PORT": str(port),
                "INFERLINE_KAFKA_DIR": str(root / f"node{i + 1}"),
                "INFERLINE_KAFKA_NODE_ID": str(i + 1),
                "INFERLINE_KAFKA_VOTERS": voters,
                "INFERLINE_KAFKA_CLUSTER_ID": cluster_id,
                "INFERLINE_KAFKA_HEAP": "-Xmx256m -Xms128m",
                "INFERLINE_KAFKA__BOOTSTRAP_SERVERS": f"localhost:{port}",
            }
            for i, port in enumerate(self.ports)
        ]
        self.bootstrap = ",".join(f"localhost:{p}" for p in self.ports)

    def run(self, command: str) -> None:
        """`kafka.sh command` on every node at once (no node answers before a majority runs)."""
        procs = [
            subprocess.Popen(
                [str(KAFKA_SH), command],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for env in self.envs
        ]
        failed = [p.communicate(timeout=240)[1] for p in procs if p.wait(timeout=240) != 0]
        assert not failed, failed

    def kill(self, node: int) -> None:
        pid = int((Path(self.envs[node]["INFERLINE_KAFKA_DIR"]) / "kafka.pid").read_text())
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    nodes = Cluster(tmp_path_factory.mktemp("kafka-cluster"))
    nodes.run("start")
    try:
        yield nodes
    finally:
        nodes.run("stop")


async def describe(bootstrap: str, topic: str) -> dict:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (meta,) = await admin.describe_topics([topic])
        return meta
    finally:
        await admin.close()


async def test_topics_take_the_clusters_replicas_and_a_stream_survives_a_node(
    cluster, model_runner
):
    stem = uuid.uuid4().hex[:6]
    topics = Topics(f"rep-req-{stem}", f"rep-cancel-{stem}", f"rep-dlq-{stem}", "")
    admin = AIOKafkaAdminClient(bootstrap_servers=cluster.bootstrap)
    await admin.start()
    try:  # no replication factor named: the broker's default (was a hard-coded 1)
        await create_topics(admin, [(topics.requests, 2), (topics.cancel, 1), (topics.dlq, 1)])
    finally:
        await admin.close()
    assert {
        len(p["replicas"])
        for p in (await describe(cluster.bootstrap, topics.requests))["partitions"]
    } == {NODES}
    settings = Settings(
        **worker_config(cluster.bootstrap, topics, kafka={"group_id": f"rep-{stem}"})
    )
    worker = Worker(settings, LLMEngine(model_runner, engine_settings(settings)))
    task = asyncio.create_task(worker.run())
    client = InferenceClient(
        cluster.bootstrap, request_topic=topics.requests, cancel_topic=topics.cancel
    )
    try:
        await wait_ready(worker, task, timeout=120)
        async with client:
            replies = await describe(cluster.bootstrap, client.reply_topic)
            assert {len(p["replicas"]) for p in replies["partitions"]} == {NODES}
            handle = await client.submit("Count to twenty.", max_tokens=48, ignore_eos=True)
            async for _ in handle.text():
                cluster.kill(NODES - 1)  # mid-stream: a replica of everything is gone
                break
            first = await asyncio.wait_for(handle.result(), 180)
            second = await asyncio.wait_for(
                (await client.submit("Say hi.", max_tokens=4)).result(), 180
            )
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 90)
    assert (first.finish_reason, first.usage.completion_tokens) == ("length", 48)
    assert second.finish_reason == "length"
