"""Producer metadata with many reply topics: the worker's producers, pruned, against a plain
producer, which keeps every topic it ever wrote to.

    python -m bench.reply_topics                  # 10,000 reply topics, one request each
    python -m bench.reply_topics --topics 600     # just past MAX_PRODUCER_TOPICS (the test)

On a private broker (tests.chaos_fixtures.PrivateBroker), N reply topics of one partition, then,
after a warm-up request and at most --concurrency requests in flight: (a) `worker`: the worker's
Publisher and Committer send each topic one request's events as worker/app.py does (the final
`done` committed with its input offset; the Committer's librdkafka producer is renewed past
MAX_PRODUCER_TOPICS, its topic handles read from librdkafka's statistics); (b) `baseline`: one
plain idempotent AIOKafkaProducer sends the same three events. Per variant: the producers'
metadata topic sets at the end (empty: every topic of the cluster), the topics a refresh fetches
and its time, events/s. Writes bench/results/reply-topics.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import resource
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from bench import stats

EVENTS = 3  # started, tokens, done per request


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.reply_topics", description=__doc__.split("\n")[0]
    )
    p.add_argument("--topics", type=int, default=10_000, help="reply topics, one request each")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at a time")
    p.add_argument("--heap", help="broker JVM heap flags (default: grows with --topics)")
    p.add_argument("--out", type=Path, default=stats.RESULTS / "reply-topics.json")
    args = p.parse_args(argv)
    if args.topics < 1 or args.concurrency < 1:
        p.error("--topics and --concurrency must be positive")
    return args


def reply(stem: str, i: int | str) -> str:
    return f"inferline.reply.bench-{stem}-{i}"


async def metadata(client) -> dict:
    """The client's topic set (empty: every topic of the cluster), the topics a refresh brings
    back and its median time over three."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        await client.force_metadata_update()
        times.append(time.perf_counter() - t0)
    return {
        "topics": len(client._topics),
        "cached_topics": len(client.cluster.topics()),
        "refresh_s": statistics.median(times),
    }


async def load(args, send, stem: str) -> dict:
    """The warm-up request, then every topic's at most `concurrency` at a time; `send(i, topic)`
    sends one request's events and returns once they are acknowledged."""
    if await send(-1, reply(stem, "warmup")) != "ok":
        raise RuntimeError("the warm-up request failed")
    slots, outcomes, t0 = asyncio.Semaphore(args.concurrency), {}, time.perf_counter()

    async def one(i: int) -> None:
        try:
            outcome = await send(i, reply(stem, i))
        finally:
            slots.release()
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    tasks = []
    for i in range(args.topics):
        await slots.acquire()
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    send_s = time.perf_counter() - t0
    return {
        "requests": len(tasks),
        "events": EVENTS * len(tasks),
        "outcomes": outcomes,
        "send_s": send_s,
        "events_per_s": EVENTS * len(tasks) / send_s,
    }


async def run_worker(args) -> dict:
    """The worker's Publisher and Committer, called as worker/app.py calls them."""
    from aiokafka import TopicPartition

    from inferline.config.settings import Settings
    from inferline.worker.delivery.offsets import OffsetTracker
    from inferline.worker.delivery.publisher import Publisher, ReplyStream
    from inferline.worker.delivery.commit import Committer
    from inferline.worker.service.metrics import Metrics

    requests = f"bench-reply-topics-{args.stem}.requests"
    settings = Settings(
        kafka={
            "bootstrap_servers": args.bootstrap,
            "request_topic": requests,
            "dlq_topic": f"bench-reply-topics-{args.stem}.dlq",
            "group_id": f"bench-reply-topics-{args.stem}",
        }
    )
    metrics, tracker, tp = Metrics(), OffsetTracker(), TopicPartition(requests, 0)
    handles = watch_committer_topics()
    member = await asyncio.to_thread(_GroupMember, settings)
    committer = Committer(settings, tracker, metrics)
    committer.owner = member
    publisher = Publisher(settings, metrics, "bench-worker", committer)
    await publisher.start()
    await committer.start()
    tracker.resume(tp, None, None)

    def send(i: int, topic: str) -> asyncio.Future:
        acked = asyncio.get_running_loop().create_future()
        offset = i + 1  # offset 0: the warm-up
        tracker.add(tp, offset)
        tracker.watermark(tp)  # the intake's lag gauge does this after every fetch
        rs = ReplyStream(f"bench-{i}", uuid.uuid4().hex, topic, None)
        publisher.started(rs, 0.001)
        publisher.tokens(rs, [42, 43], "ok")
        publisher.done(
            rs,
            finish_reason="length",
            prompt_tokens=3,
            completion_tokens=2,
            text="ok",
            queue_s=0.001,
            ttft_s=0.002,
            total_s=0.003,
            source=(tp, offset, 1),
            on_acked=lambda out, error=None: acked.set_result(out),
        )
        return acked

    report = await load(args, send, args.stem)
    await asyncio.to_thread(committer._producer.poll, 1.0)  # the current producer's statistics
    report.update(
        publisher_producer=await metadata(publisher._producer.client),
        committer_producer={
            "topics": len(handles[-1]),
            "producers": len(handles),
            "renewals": metrics.producer_renewals._value.get(),
        },
        send_failures=metrics.send_failures._value.get(),
    )
    await publisher.stop()
    await committer.close()
    await asyncio.to_thread(member.consumer.close)
    return report


def watch_committer_topics() -> list[set[str]]:
    """The topics each committer producer holds a librdkafka handle for (its latest statistics
    report), newest producer last: librdkafka's own count, not the committer's bookkeeping."""
    from inferline.worker.delivery import commit

    handles: list[set[str]] = []
    config = commit.producer_config

    def with_statistics(kafka, txn_id: str) -> dict:
        slot = len(handles)
        handles.append(set())

        def report(doc: str) -> None:
            handles[slot] = set(json.loads(doc)["topics"])

        return {**config(kafka, txn_id), "statistics.interval.ms": 200, "stats_cb": report}

    commit.producer_config = with_statistics  # this process is the benchmark's own
    return handles


class _GroupMember:
    """A member of the worker's group on the request topic: the committer's group metadata."""

    def __init__(self, settings) -> None:
        from confluent_kafka import Consumer

        from inferline.worker.intake.group import consumer_config

        self.consumer = Consumer(consumer_config(settings.kafka))
        self.consumer.subscribe([settings.kafka.request_topic])
        while not self.consumer.assignment():
            self.consumer.poll(0.1)

    def owns(self, tp, generation) -> bool:
        return True

    def group_metadata(self):
        return self.consumer.consumer_group_metadata()


async def run_baseline(args) -> dict:
    """One plain idempotent producer for every event, no pruning: the worker before."""
    from aiokafka import AIOKafkaProducer

    from inferline.contract.schema import (
        DoneEvent,
        StartedEvent,
        Timing,
        TokensEvent,
        Usage,
        encode_event,
    )

    producer = AIOKafkaProducer(
        bootstrap_servers=args.bootstrap, enable_idempotence=True, acks="all", linger_ms=5
    )
    await producer.start()

    async def send(i: int, topic: str) -> str:
        rid, a = f"bench-{i}", uuid.uuid4().hex
        events = [
            StartedEvent(id=rid, attempt=a, seq=0, worker="bench", queue_s=0.001),
            TokensEvent(id=rid, attempt=a, seq=1, token_ids=[42, 43], text="ok"),
            DoneEvent(
                id=rid,
                attempt=a,
                seq=2,
                finish_reason="length",
                text="ok",
                usage=Usage(prompt_tokens=3, completion_tokens=2),
                timing=Timing(queue_s=0.001, ttft_s=0.002, total_s=0.003),
            ),
        ]
        try:
            sent = [await producer.send(topic, encode_event(e), key=rid.encode()) for e in events]
            await asyncio.gather(*sent)
            return "ok"
        except Exception:  # noqa: BLE001 - counted in the outcomes
            return "failed"

    report = await load(args, send, args.stem)
    report["producer"] = await metadata(producer.client)
    await producer.stop()
    return report


# ---- the parent: broker, topics, both variants, the report --------------------------------------


async def create_all(bootstrap: str, stem: str, n: int, batch: int = 500) -> None:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=300_000)
    await admin.start()
    try:
        names = [
            f"bench-reply-topics-{stem}.requests",
            f"bench-reply-topics-{stem}.dlq",
            reply(stem, "warmup"),
            *(reply(stem, i) for i in range(n)),
        ]
        for start in range(0, len(names), batch):
            await admin.create_topics(
                [NewTopic(t, 1, 1) for t in names[start : start + batch]], timeout_ms=300_000
            )
    finally:
        await admin.close()


async def end_offsets(bootstrap: str, stem: str, n: int, timeout_ms: int = 40_000) -> dict:
    """Each reply topic's high watermark. Assigned first, so that one metadata request covers
    every topic (end_offsets alone learns one unknown topic per round trip)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, request_timeout_ms=timeout_ms
    )
    await consumer.start()
    tps = [TopicPartition(reply(stem, i), 0) for i in range(n)]
    try:
        consumer.assign(tps)
        values = list((await consumer.end_offsets(tps)).values())
    finally:
        await consumer.stop()
    # 3 events from each variant, plus the commit marker of the worker's transaction.
    return {"min": min(values), "max": max(values), "expected_min": 2 * EVENTS + 1}


def table(res: dict) -> str:
    w, b = res["runs"]["worker"], res["runs"]["baseline"]
    pub, base = w["publisher_producer"], b["producer"]

    def md(m: dict, key: str) -> str:
        if key == "refresh_s":
            return f"{1e3 * m[key]:.1f} ms"
        return str(m[key] or "all")  # an empty topic set: every topic of the cluster

    rows = [
        ("", "(a) worker (pruned)", "(b) plain producer"),
        ("outcomes", json.dumps(w["outcomes"]), json.dumps(b["outcomes"])),
        *[
            (f"metadata: {k}", md(pub, k), md(base, k))
            for k in ("topics", "cached_topics", "refresh_s")
        ],
        ("committer: librdkafka topic handles", str(w["committer_producer"]["topics"]), "-"),
        ("committer: producers renewed", str(w["committer_producer"]["renewals"]), "-"),
        ("events/s", f"{w['events_per_s']:.0f}", f"{b['events_per_s']:.0f}"),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from inferline.worker.delivery.commit import MAX_PRODUCER_TOPICS
    from tests.chaos_fixtures import PrivateBroker

    # The broker keeps each partition's active segment open: an fd each, besides ~2,000 others.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.topics + 2_000
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    started, stem = time.time(), uuid.uuid4().hex[:8]
    settings = {
        "topics": args.topics,
        "concurrency": args.concurrency,
        "max_producer_topics": MAX_PRODUCER_TOPICS,
    }
    res = stats.header("reply_topics", argv, settings=settings)
    kdir = Path(tempfile.mkdtemp(prefix="inferline-bench-reply-topics-"))
    # The broker keeps per-partition state on its heap; the default is sized for tests.
    broker = PrivateBroker(kdir, heap=args.heap or f"-Xmx{512 + args.topics // 10}m -Xms256m")
    try:
        broker.start()
        asyncio.run(create_all(broker.bootstrap, stem, args.topics))
        # CreateTopics returns before the broker leads the new partitions: wait for every one
        # (aiokafka logs each topic it does not know yet as an error meanwhile).
        logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
        asyncio.run(end_offsets(broker.bootstrap, stem, args.topics, timeout_ms=600_000))
        logging.getLogger("aiokafka").setLevel(logging.NOTSET)
        args.bootstrap, args.stem = broker.bootstrap, stem
        res["runs"] = {
            "worker": asyncio.run(run_worker(args)),
            "baseline": asyncio.run(run_baseline(args)),
        }
        res["end_offsets"] = asyncio.run(end_offsets(broker.bootstrap, stem, args.topics))
    finally:
        try:
            broker.stop()
        finally:
            shutil.rmtree(kdir, ignore_errors=True)

    def report(r: dict) -> None:
        ends = r["end_offsets"]
        print(
            table(r) + f"\nreply-topic end offsets: min {ends['min']}, max {ends['max']} "
            f"(every event delivered: {ends['min'] >= ends['expected_min']})"
        )

    return stats.save(res, args.out, started, report)


if __name__ == "__main__":
    main()
