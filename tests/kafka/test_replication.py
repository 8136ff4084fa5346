"""Replication (issue 51): a 3-node KRaft cluster of scripts/kafka.sh (INFERLINE_KAFKA_VOTERS,
three processes on localhost, every node broker and controller), one worker over the shallow
model and one gateway for the module. The topics inferline creates take the cluster's defaults, 3
replicas and min.insync.replicas 2, instead of the 1 they were made with; with the leader of the
gateway's reply topic SIGKILLed mid-stream, the client's stream and the gateway's SSE stream end
with every token once; with the leaders of the Batch API's state and files topics SIGKILLed
mid-batch, the batch completes, its output downloads whole, and a fresh gateway reads the same
batch and files back from the topics.

The engine is held between steps (Gate) so that a kill lands where the test says: requests in the
worker and unanswered, or streams begun and unfinished.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from inferline.config.settings import Settings
from inferline.producer.client import InferenceClient
from inferline.producer.gateway.batches import state_topics
from inferline.producer.gateway.server import GatewayServer
from inferline.producer.topics import create_topics
from inferline.worker.app import Worker, engine_settings
from inferline.worker.engine.engine import LLMEngine
from tests.chaos_fixtures import KAFKA_SH
from tests.gateway_fixtures import gateway_settings, start_gateway, stop_gateway
from tests.kafka.test_batch import chat_line, check_format
from tests.kafka.test_gateway_batch import client, lines_of, upload, wait_status
from tests.kafka_fixtures import free_port_pair
from tests.worker_fixtures import Topics, wait_ready, worker_config

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
NODES = 3


class Cluster:
    """NODES nodes of one static quorum, each a kafka.sh broker in a directory of its own."""

    def __init__(self, root: Path) -> None:
        self.ports: list[int] = []
        while len(self.ports) < NODES:  # pairs apart: each node's controller takes port + 1
            port = free_port_pair()
            if all(abs(port - other) > 1 for other in self.ports):
                self.ports.append(port)
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

        self.dead: set[int] = set()

    def run(self, command: str, nodes: list[int] | None = None) -> None:
        """`kafka.sh command` on every node (or `nodes`) at once (no node answers before a
        majority runs)."""
        procs = [
            subprocess.Popen(
                [str(KAFKA_SH), command],
                env=self.envs[node],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for node in (range(NODES) if nodes is None else nodes)
        ]
        failed = [p.communicate(timeout=240)[1] for p in procs if p.wait(timeout=240) != 0]
        assert not failed, failed

    def kill(self, node: int) -> None:
        pid = int((Path(self.envs[node]["INFERLINE_KAFKA_DIR"]) / "kafka.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        self.dead.add(node)

    async def leader(self, topic: str, partition: int = 0) -> int:
        """The node (0-based) that leads `topic`'s `partition`."""
        (part,) = [
            p
            for p in (await describe(self.bootstrap, topic))["partitions"]
            if p["partition"] == partition
        ]
        return part["leader"] - 1

    async def heal(self) -> None:
        """Start the nodes killed before, and wait until every partition's replicas are all in
        sync again (the next kill must leave two)."""
        if not self.dead:
            return
        await asyncio.to_thread(self.run, "start", sorted(self.dead))
        self.dead.clear()
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            await until(
                lambda: admin.describe_topics(),
                lambda metas: all(len(p["isr"]) == NODES for m in metas for p in m["partitions"]),
            )
        finally:
            await admin.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    nodes = Cluster(tmp_path_factory.mktemp("kafka-cluster"))
    nodes.run("start")
    try:
        yield nodes
    finally:
        nodes.run("stop")


async def until(probe, ok=bool, timeout: float = 180):
    """`await probe()` again until `ok` of it; its last value."""
    deadline = time.monotonic() + timeout
    while not ok(value := await probe()):
        assert time.monotonic() < deadline, f"still {value!r}"
        await asyncio.sleep(0.2)
    return value


async def describe(bootstrap: str, topic: str) -> dict:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (meta,) = await admin.describe_topics([topic])
        return meta
    finally:
        await admin.close()


async def topic_config(bootstrap: str, topic: str, name: str) -> str:
    """The value of `topic`'s config `name` (its own or the broker's default)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (response,) = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic, {name: None})]
        )
        (res,) = response.to_object()["resources"]
        return {e["config_names"]: e["config_value"] for e in res["config_entries"]}[name]
    finally:
        await admin.close()


class Gate:
    """How many more steps the engine may run: None (open) or a count; `added` counts requests
    into the engine."""

    def __init__(self) -> None:
        self.left: int | None = None
        self.added = 0

    def hold(self, steps: int = 0) -> None:
        self.left = steps

    def open(self) -> None:
        self.left = None


class GatedEngine(LLMEngine):
    """An engine that idles (still taking requests in) while its gate is held."""

    def __init__(self, *args, gate: Gate, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = gate

    def add_request(self, req) -> None:
        self.gate.added += 1
        super().add_request(req)

    def has_unfinished_requests(self) -> bool:
        left = self.gate.left
        return super().has_unfinished_requests() and (left is None or left > 0)

    def step(self):
        if self.gate.left is not None:
            self.gate.left -= 1
        return super().step()


@dataclass
class ClusterFleet:
    topics: Topics
    worker: Worker
    gate: Gate
    settings: Settings  # the gateway's
    server: GatewayServer
    url: str

    @property
    def reply_topic(self) -> str:
        return f"{self.settings.kafka.reply_topic_prefix}{self.settings.gateway.reply_topic}"

    async def requests_in(self, count: int) -> None:
        """Wait until `count` more requests than now are in the engine."""
        target = self.gate.added + count

        async def added() -> int:
            return self.gate.added

        await until(added, lambda n: n >= target)


@pytest.fixture(scope="module")
async def fleet(cluster, shallow_runner):
    """The worker's topics (the cluster's defaults), a worker over the shallow model behind a
    Gate, and a gateway whose reply topic, named so that another replica shares it, has one
    partition (one leader to kill)."""
    stem = uuid.uuid4().hex[:6]
    topics = Topics(f"rep-req-{stem}", f"rep-cancel-{stem}", f"rep-dlq-{stem}", "")
    admin = AIOKafkaAdminClient(bootstrap_servers=cluster.bootstrap)
    await admin.start()
    try:  # no replication factor named: the broker's default (was a hard-coded 1)
        await create_topics(admin, [(topics.requests, 2), (topics.cancel, 1), (topics.dlq, 1)])
    finally:
        await admin.close()
    settings = Settings(
        **worker_config(cluster.bootstrap, topics, kafka={"group_id": f"rep-{stem}"})
    )
    gate = Gate()
    worker = Worker(settings, GatedEngine(shallow_runner, engine_settings(settings), gate=gate))
    task = asyncio.create_task(worker.run())
    await wait_ready(worker, task, timeout=120)
    gateway = gateway_settings(
        cluster.bootstrap,
        topics,
        reply_topic=f"rep-gateway-{stem}",  # under the reply prefix
        reply_partitions=1,
    )
    server, gtask = None, None
    try:
        server, gtask, url = await start_gateway(gateway)
        yield ClusterFleet(topics, worker, gate, gateway, server, url)
    finally:
        gate.open()
        if server is not None:
            await stop_gateway(server, gtask)
        worker.request_stop()
        await asyncio.wait_for(task, 90)


async def sse(api: openai.AsyncOpenAI, first: asyncio.Event, **body) -> list:
    """A streamed chat completion's chunks; `first` is set at the first token's."""
    chunks = []
    async for chunk in await api.chat.completions.create(stream=True, **body):
        chunks.append(chunk)
        if chunk.choices and chunk.choices[0].delta.content:
            first.set()
    return chunks


async def test_topics_take_the_clusters_replicas_and_streams_survive_the_reply_leader(
    cluster, fleet
):
    """The client's stream and the gateway's SSE stream, begun and unfinished (the engine held
    after four steps) when the leader of the gateway's reply topic is SIGKILLed, end with all
    their tokens once; the next request is answered."""
    await cluster.heal()
    assert {
        len(p["replicas"])
        for p in (await describe(cluster.bootstrap, fleet.topics.requests))["partitions"]
    } == {NODES}
    client_ = InferenceClient(
        cluster.bootstrap, request_topic=fleet.topics.requests, cancel_topic=fleet.topics.cancel
    )
    api, first_sse = client(fleet.url), asyncio.Event()
    async with client_:
        for replies in (client_.reply_topic, fleet.reply_topic):
            meta = await describe(cluster.bootstrap, replies)
            assert {len(p["replicas"]) for p in meta["partitions"]} == {NODES}, replies
        fleet.gate.hold()  # both in the engine before its first step
        handle = await client_.submit("Count to twenty.", max_tokens=48, ignore_eos=True)
        streaming = asyncio.create_task(
            sse(
                api,
                first_sse,
                model=fleet.settings.gateway.model_name,
                messages=[{"role": "user", "content": "Name the planets."}],
                max_tokens=48,
                temperature=0,
                logprobs=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        await fleet.requests_in(2)
        fleet.gate.hold(4)  # a prefill and three tokens each, then the engine waits
        async for _ in handle.text():
            break
        await asyncio.wait_for(first_sse.wait(), 120)
        cluster.kill(await cluster.leader(fleet.reply_topic))
        fleet.gate.open()
        first = await asyncio.wait_for(handle.result(), 180)
        chunks = await asyncio.wait_for(streaming, 180)
        second = await asyncio.wait_for(
            (await client_.submit("Say hi.", max_tokens=4)).result(), 180
        )
    assert (first.finish_reason, first.usage.completion_tokens) == ("length", 48)
    assert second.finish_reason == "length"
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len(tokens) == chunks[-1].usage.completion_tokens == 48  # none lost, none twice


@pytest.mark.full  # one or two SIGKILLs and broker restarts: a minute and more (make test-full)
async def test_a_batchs_state_and_files_survive_their_leaders_sigkill(cluster, fleet):
    """The Batch API's topics have 3 replicas and min.insync.replicas 2; a batch whose requests
    are in the worker, unanswered, when the state topic's leader is SIGKILLed (and then the files
    topic's, if another node) completes; its output downloads whole; a fresh gateway reads the
    same batch and files back from the topics."""
    await cluster.heal()
    files_topic, state_topic = state_topics(fleet.settings)
    for topic in (files_topic, state_topic):
        meta = await describe(cluster.bootstrap, topic)
        assert {len(p["replicas"]) for p in meta["partitions"]} == {NODES}, topic
        assert await topic_config(cluster.bootstrap, topic, "min.insync.replicas") == "2"
    api = client(fleet.url)
    lines = [chat_line(f"r{i}", f"Name {i} colours.", max_tokens=8) for i in range(6)]
    upload_ = await upload(api, lines)
    fleet.gate.hold()
    batch = await api.batches.create(
        input_file_id=upload_.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    await fleet.requests_in(len(lines))
    assert (await api.batches.retrieve(batch.id)).status == "in_progress"
    state_leader, files_leader = [await cluster.leader(t) for t in (state_topic, files_topic)]
    cluster.kill(state_leader)  # the batch's progress and its end go to the next leader
    fleet.gate.open()
    done = await wait_status(api, batch.id)
    assert done.status == "completed", done
    counts = (done.request_counts.total, done.request_counts.completed, done.request_counts.failed)
    assert counts == (len(lines), len(lines), 0)
    output = (await api.files.content(done.output_file_id)).content
    if files_leader != state_leader:  # the files' leader too, once the first node is back
        await cluster.heal()
        cluster.kill(files_leader)
    server, task, url = await start_gateway(fleet.settings)  # reads both topics from the start
    try:
        fresh = client(url)
        seen = await fresh.batches.retrieve(batch.id)
        assert (seen.status, seen.output_file_id) == ("completed", done.output_file_id)
        assert seen.request_counts == done.request_counts
        assert (await fresh.files.content(done.output_file_id)).content == output
        assert (await fresh.files.retrieve(done.output_file_id)).bytes == len(output)
        assert (await fresh.files.content(upload_.id)).text == "\n".join(lines) + "\n"
        outs = await lines_of(fresh, done.output_file_id)
    finally:
        await stop_gateway(server, task)
    assert sorted(o["custom_id"] for o in outs) == [f"r{i}" for i in range(len(lines))]
    for out in outs:
        check_format(out)
    assert [json.loads(line) for line in output.decode().splitlines()] == outs
