"""A flood of requests naming distinct missing reply topics against honest requests (issue 38).

    INFERLINE_KAFKA__BOOTSTRAP_SERVERS=localhost:9092 python -m bench.reply_topic_flood
    python -m bench.reply_topic_flood --flood 10000 --honest 2000 --rate 400 --list-delay-ms 50

The worker's real intake (`Intake._fetch_loop`, decode, reply-topic policy and lookups, triage)
over a stand-in consumer that releases records at their arrival times (honest requests at
--rate per second, the flood spread evenly over the same span, batches of at most 64 as
`getmany` returns them), with the topic list read from a real broker (plus --list-delay-ms, the
cost of listing a large cluster's topics). Sink: admissions and dead letters are recorded, nothing
runs. Reported per run (honest alone, then honest + flood, ABAB over --rounds): the honest
requests' intake latency (arrival to admission) p50 / p99, the topic lists read, the flood's
dead letters; and the flood / alone ratio of the honest p50 and p99. Runs against whatever
`worker` package is first on the path (PYTHONPATH=/path/to/older/checkout for a before figure).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid

import msgpack
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord


class Sink:
    """Records what the intake decides; room without bound, nothing runs."""

    def __init__(self) -> None:
        self.admitted: dict[str, float] = {}
        self.dead = 0

    def room(self) -> int:
        return 1_000_000

    def pool_full(self) -> bool:
        return False

    def hold(self, tp, record) -> None:
        pass

    def dead_letter(self, record, reason: str) -> None:
        self.dead += 1

    def reject(self, *args, **kwargs) -> None:
        raise AssertionError(f"unexpected rejection {args[3:5]}")

    def admit(self, adm) -> None:
        self.admitted[adm.request.id] = time.monotonic()


class Consumer:
    """Releases (arrival time, record) pairs once their time has come, 64 at most per getmany."""

    def __init__(self, tp: TopicPartition, timeline: list) -> None:
        self.tp, self.timeline, self.start = tp, timeline, None

    def assignment(self):
        return {self.tp}

    def paused(self):
        return set()

    def pause(self, *tps):
        pass

    def resume(self, *tps):
        pass

    async def stop(self):
        pass

    async def getmany(self, timeout_ms, max_records):
        if self.start is None:
            self.start = time.monotonic()
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            now = time.monotonic() - self.start
            batch = []
            while self.timeline and self.timeline[0][0] <= now and len(batch) < min(64, max_records):
                batch.append(self.timeline.pop(0)[1])
            if batch or time.monotonic() >= deadline:
                return {self.tp: batch} if batch else {}
            await asyncio.sleep(0.001)


def record(tp: TopicPartition, offset: int, request_id: str, reply_topic: str) -> ConsumerRecord:
    value = msgpack.packb({"v": 1, "id": request_id, "reply_topic": reply_topic, "prompt": "Hi.", "max_tokens": 4})
    return ConsumerRecord(tp.topic, tp.partition, offset, 0, 0, b"k", value, None, 1, len(value), [])


async def one_run(settings, honest_topic: str, args, flood: int) -> dict:
    from inferline.worker.delivery.offsets import OffsetTracker
    from inferline.worker.delivery.transactions import Transactions
    from inferline.worker.intake.cancels import RecentCancels
    from inferline.worker.intake.group import Intake
    from inferline.worker.service.metrics import Metrics
    from inferline.worker.service.ratelimit import RateLimiter

    tp = TopicPartition(settings.kafka.request_topic, 0)
    span = args.honest / args.rate
    items = [(i / args.rate, "honest", f"h{i}", honest_topic) for i in range(args.honest)]
    items += [(i * span / max(1, flood), "flood", f"f{i}", f"inferline.reply.missing-{uuid.uuid4().hex}")
              for i in range(flood)]
    items.sort(key=lambda item: item[0])
    arrival = {rid: at for at, _, rid, _ in items}
    tracker, metrics, sink = OffsetTracker(), Metrics(), Sink()
    tracker.resume(tp, 0, None)
    intake = Intake(settings, sink, tracker, RateLimiter(settings.limits), metrics,
                    RecentCancels(), Transactions(settings, tracker, metrics))
    intake._consumer = Consumer(tp, [(at, record(tp, n, rid, topic)) for n, (at, _, rid, topic) in enumerate(items)])
    intake.lag.update = lambda: None
    lists = {"n": 0}
    real_list = intake._list_topics

    async def list_topics():
        lists["n"] += 1
        await asyncio.sleep(args.list_delay_ms / 1000)
        return await real_list()
    intake.reply_topics._list_topics = list_topics
    await intake.reply_topics.refresh()  # the honest topic is known, as on a worker that has run a while
    lists["n"] = 0
    task = asyncio.create_task(intake._fetch_loop())
    while len(sink.admitted) < args.honest or sink.dead < flood:
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await intake.close()
    start = intake._consumer.start
    latency = sorted(sink.admitted[rid] - start - arrival[rid] for rid in sink.admitted)
    return {"flood": flood, "p50_ms": 1e3 * latency[len(latency) // 2],
            "p99_ms": 1e3 * latency[int(len(latency) * 0.99)], "mean_ms": 1e3 * statistics.fmean(latency),
            "lists": lists["n"], "dead_letters": sink.dead}


async def main_async(args) -> None:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from inferline.config.settings import Settings

    settings = Settings()
    honest_topic = f"inferline.reply.bench-honest-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(**settings.kafka.client_options())
    await admin.start()
    await admin.create_topics([NewTopic(honest_topic, 1, 1)])
    try:
        runs = []
        for _ in range(args.rounds):
            for flood in (0, args.flood):
                runs.append(await one_run(settings, honest_topic, args, flood))
                print(json.dumps(runs[-1]))
    finally:
        await admin.delete_topics([honest_topic])
        await admin.close()
    alone = [r for r in runs if not r["flood"]]
    flooded = [r for r in runs if r["flood"]]
    for key in ("p50_ms", "p99_ms"):
        a, f = statistics.median(r[key] for r in alone), statistics.median(r[key] for r in flooded)
        print(f"honest {key}: alone {a:.1f}, with {args.flood} flood requests {f:.1f}: x{f / a:.2f}")
    print(f"topic lists read per flooded run: {[r['lists'] for r in flooded]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flood", type=int, default=10_000)
    parser.add_argument("--honest", type=int, default=2_000)
    parser.add_argument("--rate", type=float, default=400.0, help="honest requests per second")
    parser.add_argument("--list-delay-ms", type=float, default=50.0)
    parser.add_argument("--rounds", type=int, default=2)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
