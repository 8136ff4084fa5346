"""The JSON encoding from a tool that knows nothing of msgpack: Debian's kcat produces JSON requests
with `content-type: application/json` and reads the reply topic, and a running worker answers each
in JSON with that header (docs/protocol.md "Encodings"); the Python client's JSON option too. kcat
comes from deploy/kcat/tools.sh (`make kcat-tools`, run by `make test`) or the PATH; the test
skips, saying why, without it. Kafka Connect's conventions too (marked `full`: a JVM start costs
about 20 s here): a file source with the InsertHeader transform produces the request, a file sink
with JsonConverter (schemas.enable=false) reads the events. The codec's own rules:
tests/unit/test_json_encoding.py."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from inferline.contract.schema import JSON
from inferline.producer.client import InferenceClient
from tests.worker_fixtures import request, start_worker, topics  # noqa: F401 - fixtures

pytestmark = pytest.mark.kafka
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
TOOLS = DEPLOY / "kcat" / "tools.sh"
CONNECT_TOOLS = DEPLOY / "kafka-connect" / "tools.sh"


def kcat_path() -> str:
    """The wrapper deploy/kcat/tools.sh caches, else kcat on the PATH; skips without either."""
    done = subprocess.run([str(TOOLS), "--paths"], capture_output=True, text=True, check=True)
    path = done.stdout.strip()
    if os.access(path, os.X_OK):
        return path
    found = shutil.which("kcat") or shutil.which("kafkacat")
    if found is None:
        pytest.skip("kcat is missing: deploy/kcat/tools.sh (make kcat-tools) could not install it")
    return found


async def kcat(*args: str, stdin: bytes = b"") -> str:
    proc = await asyncio.create_subprocess_exec(
        kcat_path(),
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 30)
    assert proc.returncode == 0, err.decode()
    return out.decode()


def headers_of(record: dict) -> dict[str, str]:
    flat = record["headers"] or []  # kcat -J: [key, value, key, value, ...]
    return dict(zip(flat[::2], flat[1::2]))


def by_id(records: list[dict]) -> dict[str, list[tuple[dict, dict]]]:
    """kcat -J's records -> request id -> (headers, event) in reply-topic order."""
    out: dict[str, list] = {}
    for record in records:
        event = json.loads(record["payload"])  # JSON, or this fails
        assert record["key"] == event["id"]
        out.setdefault(event["id"], []).append((headers_of(record), event))
    return out


async def read_until(bootstrap: str, topic: str, enough, timeout: float = 30.0) -> list[dict]:
    """The topic's records as kcat -J reads them (read_committed), until `enough(records)`."""
    deadline = time.monotonic() + timeout
    while True:
        lines = await kcat("-C", "-b", bootstrap, "-t", topic, "-o", "beginning", "-e", "-J")
        records = [json.loads(line) for line in lines.splitlines() if line]
        if enough(records):
            return records
        assert time.monotonic() < deadline, f"not enough on {topic}: {records}"
        await asyncio.sleep(0.3)


def all_done(ids: list[str]):
    def enough(records: list[dict]) -> bool:
        replies = by_id(records)
        return all(any(e["type"] == "done" for _, e in replies.get(i, [])) for i in ids)

    return enough


async def test_kcat_sends_json_requests_and_reads_json_events(
    kafka_bootstrap, topics, start_worker
):
    kcat_path()  # skips, before a worker starts, where there is none
    await start_worker(topics, model={"max_model_len": 256})
    good = request(topics.replies, max_tokens=4, created_at=time.time())
    rejected = request(topics.replies, temperature=-1.0)
    produced = [good, rejected]
    for req in produced:
        await kcat(
            "-P", "-b", kafka_bootstrap, "-t", topics.requests, "-k", req["id"],
            "-H", "content-type=application/json", stdin=json.dumps(req).encode(),
        )  # fmt: skip
    # JSON without the header is read as msgpack, the default: dead-lettered, saying why.
    unmarked = json.dumps(request(topics.replies)).encode()
    await kcat("-P", "-b", kafka_bootstrap, "-t", topics.requests, stdin=unmarked)
    # The Python client sends JSON too, and reads JSON events back.
    async with InferenceClient(
        kafka_bootstrap,
        request_topic=topics.requests,
        reply_topic=topics.replies,
        content_type=JSON,
    ) as client:
        handle = await client.submit("Say hello.", max_tokens=4, temperature=0.0)
        result = await asyncio.wait_for(handle.result(), 30)
    assert result.finish_reason in ("stop", "length") and client.undecodable == 0
    ids = [r["id"] for r in produced] + [handle.id]
    replies = by_id(await read_until(kafka_bootstrap, topics.replies, all_done(ids)))

    for request_id in ids:
        records = replies[request_id]
        assert [h.get("content-type") for h, _ in records] == ["application/json"] * len(records)
        events = [e for _, e in records]
        assert [e["seq"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] == "done" and len({e["attempt"] for e in events}) == 1
    assert [e for _, e in replies[handle.id]][-1]["text"] == result.text
    streamed = [e for _, e in replies[good["id"]]]
    assert streamed[0]["type"] == "started" and streamed[-1]["finish_reason"] in ("stop", "length")
    assert "".join(e["text"] for e in streamed if e["type"] == "tokens") == streamed[-1]["text"]
    (done,) = [e for _, e in replies[rejected["id"]]]
    assert done["finish_reason"] == "rejected" and "temperature" in done["error"]["message"]
    (dead,) = await read_until(kafka_bootstrap, topics.dlq, bool)
    assert "content-type: application/json" in headers_of(dead)["error"]
    assert dead["payload"] == unmarked.decode()


def connect_libs() -> Path:
    """Kafka Connect's classpath folder (deploy/kafka-connect/tools.sh fetches it once); skips
    without it."""
    done = subprocess.run([str(CONNECT_TOOLS)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.skip(
            f"Kafka Connect is missing: deploy/kafka-connect/tools.sh: {done.stderr[-300:]}"
        )
    return Path(done.stdout.strip())


def properties(path: Path, **settings: str) -> str:
    path.write_text(
        "".join(f"{key.replace('_', '.')}={value}\n" for key, value in settings.items())
    )
    return str(path)


@pytest.mark.full
async def test_kafka_connect_produces_a_request_and_reads_the_events_as_json(
    kafka_bootstrap, topics, start_worker, tmp_path
):
    libs = connect_libs()
    await start_worker(topics, model={"max_model_len": 256})
    req = request(topics.replies, max_tokens=4)
    (tmp_path / "in.txt").write_text(json.dumps(req) + "\n")
    sink_file = tmp_path / "out.txt"
    sink_file.write_text("")
    string = "org.apache.kafka.connect.storage.StringConverter"
    worker = properties(
        tmp_path / "worker.properties",
        bootstrap_servers=kafka_bootstrap,
        key_converter=string,
        value_converter=string,
        offset_storage_file_filename=str(tmp_path / "offsets"),
        offset_flush_interval_ms="1000",
        listeners="http://127.0.0.1:0",
    )
    source = properties(
        tmp_path / "source.properties",
        name="requests-in",
        connector_class="org.apache.kafka.connect.file.FileStreamSourceConnector",
        file=str(tmp_path / "in.txt"),
        topic=topics.requests,
        transforms="json",  # Connect's own transform marks each record as JSON
        transforms_json_type="org.apache.kafka.connect.transforms.InsertHeader",
        transforms_json_header="content-type",
        transforms_json_value_literal="application/json",
    )
    sink = properties(
        tmp_path / "sink.properties",
        name="replies-out",
        connector_class="org.apache.kafka.connect.file.FileStreamSinkConnector",
        file=str(sink_file),
        topics=topics.replies,
        value_converter="org.apache.kafka.connect.json.JsonConverter",
        value_converter_schemas_enable="false",
        consumer_override_isolation_level="read_committed",
        consumer_override_auto_offset_reset="earliest",
    )
    main = "org.apache.kafka.connect.cli.ConnectStandalone"
    with open(tmp_path / "connect.log", "wb") as log:
        proc = subprocess.Popen(
            ["java", "-Xmx256m", "-cp", f"{libs}/*", main, worker, source, sink],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while "type=done" not in sink_file.read_text():
            assert proc.poll() is None, (tmp_path / "connect.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "connect.log").read_text()[-3000:]
            await asyncio.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(30)
    # The sink writes each event as JsonConverter parsed it (a Java map), in reply-topic order.
    text = sink_file.read_text()
    events = text.count(f"id={req['id']}")
    assert events >= 3 and text.count("type=") == events  # every event, all of this request
    assert "type=started" in text.splitlines()[0] and "finish_reason=length" in text
