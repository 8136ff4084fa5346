"""Issue 52: a flood of 100,000 records of one tenant, all in Kafka before the worker starts, keeps
the worker's memory bounded (the lanes hold INFERLINE_LANES__MAX_RECORDS of it, the rest waits in
Kafka) and loses nothing across a SIGKILL: the worker is killed a third of the way through and
started again, and every request ends with exactly one final `done` (read_committed).

A worker process over the shallow SmolLM2 (one output token per request). Measures the worker's
RSS (/proc) and the lanes' gauges (/metrics) while the flood waits; prints the figures. `make chaos`
only (marked `full` and `chaos`, skipped without --chaos-long): it runs for minutes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import urllib.request
import uuid

import msgpack
import pytest
from confluent_kafka import Consumer, Producer

from inferline.contract.schema import DoneEvent, decode_event
from tests.chaos_fixtures import WorkerProcess, private_topics

pytestmark = [pytest.mark.chaos, pytest.mark.full, pytest.mark.slow]

NUM_RECORDS = int(os.environ.get("INFERLINE_FLOOD_RECORDS", 100_000))
LANES = 1024
RSS_GROWTH_BOUND = 256 * 2**20  # bytes over the RSS at start; 100k requests held would be more


def flood_records(reply_topic: str, n: int):
    for _ in range(n):
        req = {
            "v": 1,
            "id": f"f-{uuid.uuid4().hex[:16]}",
            "reply_topic": reply_topic,
            "prompt_token_ids": [1, 2, 3],
            "max_tokens": 1,
            "ignore_eos": True,
            "tenant": "flood",
            "stream": False,
        }
        yield req["id"], msgpack.packb(req)


def produce_flood(bootstrap: str, topic: str, reply_topic: str, n: int) -> list[str]:
    """Blocking: n records to partition 0 of `topic`; their ids."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "acks": "all"})
    ids = []
    for rid, value in flood_records(reply_topic, n):
        while True:
            try:
                producer.produce(topic, value, key=rid.encode(), partition=0)
                break
            except BufferError:
                producer.poll(0.05)
        ids.append(rid)
    assert producer.flush(60) == 0
    return ids


class Finals:
    """Counts the final `done`s by request id on the reply topic (read_committed), in a thread."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.counts: dict[str, int] = {}
        self._stop = False
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"finals-{uuid.uuid4().hex[:8]}",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
            }
        )
        self._consumer.subscribe([topic])

    def run(self) -> None:
        try:
            while not self._stop:
                for m in self._consumer.consume(1000, 0.2):
                    if m.error() is None:
                        ev = decode_event(m.value())
                        if isinstance(ev, DoneEvent) and ev.finish_reason != "requeued":
                            self.counts[ev.id] = self.counts.get(ev.id, 0) + 1
        finally:
            self._consumer.close()

    def stop(self) -> None:
        self._stop = True


class Watch:
    """The worker's RSS (/proc) and lane gauges (/metrics), sampled every 0.5 s."""

    def __init__(self) -> None:
        self.rss_start = self.rss_peak = self.lane_bytes_peak = self.lane_peak = 0

    async def follow(self, worker: WorkerProcess) -> None:
        port = http_port(worker)
        self.rss_start = self.rss_start or rss(worker.proc.pid)
        while worker.alive():
            self.rss_peak = max(self.rss_peak, rss(worker.proc.pid))
            gauges = await asyncio.to_thread(scrape, port)
            self.lane_bytes_peak = max(self.lane_bytes_peak, gauges.get("bytes", 0))
            self.lane_peak = max(self.lane_peak, gauges.get("records", 0))
            await asyncio.sleep(0.5)


def rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            kb = next(line for line in f if line.startswith("VmRSS:")).split()[1]
        return int(kb) * 1024
    except (OSError, StopIteration):
        return 0


def http_port(worker: WorkerProcess) -> int:
    for line in worker.log_path.read_text(errors="replace").splitlines():
        if '"worker.starting"' in line:
            return json.loads(line)["http_port"]
    raise AssertionError("no worker.starting line")


def scrape(port: int) -> dict[str, float]:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
    except OSError:
        return {}
    out = {"records": 0.0}
    for line in text.decode().splitlines():
        if line.startswith("inferline_lane_bytes "):
            out["bytes"] = float(line.split()[1])
        elif re.match(r"inferline_tenant_lane_requests\{", line):
            out["records"] += float(line.split()[-1])
    return out


async def wait_finals(finals: Finals, at_least: int, worker: WorkerProcess, watch, timeout: float):
    start = time.monotonic()
    next_print = start + 60
    while len(finals.counts) < at_least:
        assert worker.alive(), f"the worker exited: see {worker.log_path}"
        assert time.monotonic() - start < timeout, f"{len(finals.counts)} finals of {at_least}"
        if time.monotonic() >= next_print:  # progress, for a run cut short
            next_print += 60
            rss, lanes = watch.rss_peak / 2**20, watch.lane_peak
            print(f"{len(finals.counts)} finals, RSS peak {rss:.0f} MiB, lanes peak {lanes}")
        await asyncio.sleep(0.5)


async def test_a_100k_flood_keeps_memory_bounded_and_loses_nothing_across_a_sigkill(
    kafka_bootstrap, shallow_smollm2, tmp_path, request
):
    if not request.config.getoption("--chaos-long"):
        pytest.skip("make chaos only (--chaos-long): minutes of a worker process")
    topics = await private_topics(kafka_bootstrap, "flood", 1, 4)
    t0 = time.monotonic()
    ids = await asyncio.to_thread(
        produce_flood, kafka_bootstrap, topics.requests, topics.replies, NUM_RECORDS
    )
    produced_s = time.monotonic() - t0
    worker = WorkerProcess(
        "flood",
        kafka_bootstrap,
        topics,
        tmp_path,
        kafka={"group_id": f"flood-{uuid.uuid4().hex[:8]}"},  # one group across the restart
        model={"path": str(shallow_smollm2), "max_model_len": 64},
        cache={"num_blocks": 1024},
        scheduler={"max_num_seqs": 128, "max_waiting": 256, "max_num_batched_tokens": 512},
        lanes={"max_records": LANES},
        worker={"drain_timeout_s": 5},
    )
    finals = Finals(kafka_bootstrap, topics.replies)
    reader = asyncio.create_task(asyncio.to_thread(finals.run))
    watch = Watch()
    try:
        t1 = time.monotonic()
        worker.spawn()
        await worker.wait_started()
        watcher = asyncio.create_task(watch.follow(worker))
        await wait_finals(finals, NUM_RECORDS // 3, worker, watch, timeout=3600)
        worker.kill()
        killed_at = len(finals.counts)
        await watcher
        worker.spawn()
        await worker.wait_started()
        watcher = asyncio.create_task(watch.follow(worker))
        await wait_finals(finals, NUM_RECORDS, worker, watch, timeout=3600)
        run_s = time.monotonic() - t1
        await asyncio.sleep(2.0)  # a duplicate final would come with the last transactions
    finally:
        if worker.alive():
            await worker.terminate()
        finals.stop()
        await reader
    lost = set(ids) - set(finals.counts)
    doubled = [i for i, n in finals.counts.items() if n > 1]
    report = {
        "records": NUM_RECORDS,
        "produce_s": round(produced_s, 1),
        "run_s": round(run_s, 1),
        "killed_after_finals": killed_at,
        "rss_start_mib": round(watch.rss_start / 2**20, 1),
        "rss_peak_mib": round(watch.rss_peak / 2**20, 1),
        "lane_records_peak": watch.lane_peak,
        "lane_bytes_peak_kib": round(watch.lane_bytes_peak / 1024, 1),
        "lost": len(lost),
        "doubled": len(doubled),
    }
    print(f"\nflood of {NUM_RECORDS:,}: {json.dumps(report)}")
    assert not lost and not doubled, report
    assert watch.lane_peak <= LANES, report
    assert watch.rss_peak - watch.rss_start <= RSS_GROWTH_BOUND, report
