"""What a final result costs in a transaction: a worker's `done`s committed with their input offsets
(worker/delivery/transactions.py, one transaction per partition at a time, everything queued going in the
next one) against the at-least-once path it replaced (the `done` through the idempotent producer,
the offset committed by the consumer group every 200 ms), side by side on the same broker.

Each run queues `--dones` final results at `--rate` per second (0: all at once) on one input
partition and measures, per `done`, the time from queueing to the moment a read_committed reader
of the reply topic has it, and the `done`s per second over the run. Prints a table, writes
bench/results/transactions.json.

    python -m bench.transactions [--dones 2000] [--rate 200]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
import uuid
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from bench.broker import acquire_broker, release_broker
from inferline.config.settings import Settings
from inferline.contract.schema import DoneEvent, Timing, Usage, encode_event
from inferline.worker.service.metrics import Metrics
from inferline.worker.delivery.offsets import OffsetTracker
from inferline.worker.delivery.transactions import Final, Transactions

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.transactions", description=__doc__.split("\n\n")[0])
    p.add_argument("--dones", type=int, default=2000, help="final results per path")
    p.add_argument("--rate", type=float, default=200.0, help="dones queued per second (0: all at once)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "transactions.json")
    return p.parse_args(argv)


def done_value(rid: str) -> bytes:
    return encode_event(DoneEvent(id=rid, attempt=uuid.uuid4().hex, seq=3, finish_reason="length",
                                  usage=Usage(prompt_tokens=20, completion_tokens=64),
                                  timing=Timing(queue_s=0.01, ttft_s=0.05, total_s=1.0), text="x" * 256))


class Reader:
    """A read_committed reader of the reply topic: when each request id's `done` became visible."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.seen: dict[str, float] = {}
        self._consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest",
                                          isolation_level="read_committed", fetch_max_wait_ms=5)
        self._topic, self._task = topic, None

    async def start(self) -> None:
        await self._consumer.start()
        self._consumer.assign([TopicPartition(self._topic, 0)])
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            for records in (await self._consumer.getmany(timeout_ms=50)).values():
                now = time.perf_counter()
                for r in records:
                    self.seen.setdefault(r.key.decode(), now)

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._consumer.stop()


async def paced(n: int, rate: float, submit) -> dict[str, float]:
    """Calls submit(request id) n times at `rate` per second; returns id -> when queued."""
    queued, start = {}, time.perf_counter()
    for i in range(n):
        if rate > 0:
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        rid = f"r-{uuid.uuid4().hex[:12]}"
        queued[rid] = time.perf_counter()
        submit(i, rid)
    return queued


async def run_transactional(bootstrap: str, topics: dict, args) -> dict[str, float]:
    settings = Settings(kafka={"bootstrap_servers": bootstrap, "group_id": f"bench-{uuid.uuid4().hex[:8]}"})
    tp, tracker = TopicPartition(topics["requests"], 0), OffsetTracker()
    txns = Transactions(settings, tracker, Metrics())
    await txns.open([tp])
    committed: list[str] = []

    def submit(offset: int, rid: str) -> None:
        tracker.add(tp, offset)
        txns.submit(tp, Final(offset, [(topics["tx"], 0, rid.encode(), done_value(rid), None)],
                              lambda outcome, error=None: committed.append(outcome)))

    queued = await paced(args.dones, args.rate, submit)
    while len(committed) < args.dones:
        await asyncio.sleep(0.01)
    await txns.close_all()
    return queued


async def run_at_least_once(bootstrap: str, topics: dict, args) -> dict[str, float]:
    """The replaced path: the `done` is visible once the idempotent producer's send is acked (its
    offset was committed afterwards, off the `done`'s path)."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all", linger_ms=5)
    await producer.start()
    acked: list = []

    def submit(offset: int, rid: str) -> None:
        acked.append(asyncio.ensure_future(producer.send(topics["plain"], done_value(rid), key=rid.encode(),
                                                         partition=0)))

    queued = await paced(args.dones, args.rate, submit)
    await asyncio.gather(*[await f for f in acked])
    await producer.stop()
    return queued


def summary(name: str, queued: dict[str, float], seen: dict[str, float]) -> dict:
    lat = sorted((seen[r] - t) * 1000 for r, t in queued.items() if r in seen)
    span = max(seen[r] for r in queued if r in seen) - min(queued.values())

    def pct(q: float) -> float:
        return round(lat[min(len(lat) - 1, int(q / 100 * len(lat)))], 1)

    return {"path": name, "dones": len(queued), "visible": len(lat), "p50_ms": pct(50), "p99_ms": pct(99),
            "dones_per_s": round(len(lat) / span, 1)}


async def bench(args) -> dict:
    settings = Settings()
    held = acquire_broker(settings)
    bootstrap = settings.kafka.bootstrap_servers
    stem = uuid.uuid4().hex[:8]
    topics = {"requests": f"bench-txn-req-{stem}", "tx": f"inferline.reply.bench-txn-{stem}",
              "plain": f"inferline.reply.bench-plain-{stem}"}
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(t, 1, 1) for t in topics.values()])
        await asyncio.sleep(1.0)
        rows = []
        for name, run, topic in (("at-least-once (replaced)", run_at_least_once, "plain"),
                                 ("transactional", run_transactional, "tx")):
            reader = Reader(bootstrap, topics[topic])
            await reader.start()
            queued = await run(bootstrap, topics, args)
            deadline = time.perf_counter() + 30
            while len(set(queued) & set(reader.seen)) < len(queued) and time.perf_counter() < deadline:
                await asyncio.sleep(0.05)
            await reader.stop()
            rows.append(summary(name, queued, reader.seen))
        await admin.delete_topics(list(topics.values()))
    finally:
        await admin.close()
        if held:
            release_broker()
    return {"cpu": platform.processor() or platform.machine(), "rate": args.rate, "rows": rows,
            "extra_p50_ms": round(rows[1]["p50_ms"] - rows[0]["p50_ms"], 1),
            "throughput_ratio": round(rows[1]["dones_per_s"] / rows[0]["dones_per_s"], 3)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = asyncio.run(bench(args))
    print(f"{'path':28} {'dones':>6} {'p50 ms':>8} {'p99 ms':>8} {'dones/s':>9}")
    for r in report["rows"]:
        print(f"{r['path']:28} {r['visible']:>6} {r['p50_ms']:>8} {r['p99_ms']:>8} {r['dones_per_s']:>9}")
    print(f"transactions: +{report['extra_p50_ms']} ms p50 per done, throughput x{report['throughput_ratio']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
