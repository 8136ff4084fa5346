"""What read_committed costs a streaming reader, and what delivery costs the broker (issue 36).

    python -m bench.read_committed                  # scenario 1 before and after, then scenario 2
    python -m bench.read_committed --no-kill        # scenario 1 and the broker CPU only
    python -m bench.read_committed --engine model   # the real model instead of the paced engine

The engine is bench/paced_engine.py unless `--engine model`: a token per running request every
`--step-ms` (a GPU's decode pace), nothing computed, so the broker's CPU is measured at a real
event rate and the two cores stay the broker's; everything else is the real worker and broker.

Scenario 1, steady: one Worker in this process (group mode) serves `--num-requests` streaming
requests submitted at `--rate` per second (0: all at once), each `--max-tokens` long, all
answering on one reply topic of `--reply-partitions` partitions (keyed by request id, so every
partition carries many requests' tokens and finals). It runs once per `--delivery` config, in
order: `before` (tokens every 20 ms, a partition's next transaction as soon as the last commits:
what #36 found) and `after` (the settings as they are). Two readers read the reply topic side by
side with the project client's consumer settings, one read_uncommitted, one read_committed. Per
reader: TTFT (submit -> first `tokens` event) and the gaps between one request's `tokens` events
(p50/p99/max), and the ratio committed/uncommitted; per event seen by both, the hold (committed
arrival - uncommitted arrival); reply records per request, transactions and finals per
transaction.

Broker CPU per request (bench/broker.py: /proc, as bench/kafka_e2e.py), per config: around
scenario 1 (transactional group mode), and around a baseline that replays the same records with no
transaction: every request record and every reply record scenario 1 produced (same keys, values,
partitions, same relative send times) through one idempotent producer (acks=all, linger 5 ms, as
the Publisher), with the same two readers attached; no consumer group, no transactions. Each is
also given with an idle window of the same length subtracted (worker and readers connected,
nothing sent; readers only, for the baseline). The first config runs once unmeasured before them
(a broker just started spends about twice as much per request for its first minutes), and each
row says what that CPU per request would be for a fleet at 10^5 requests/s. `--max-tokens 48,256`
runs every config per stream length and `--rate 20,80` per submission rate (a partition's
transactions and token flushes are paced by intervals, not by requests, so their cost per request
falls as the rate a worker serves rises); `--delivery` may add `txn-1s` (transactions at most once a
second per partition).

Scenario 2, a worker dies: two worker subprocesses (`python -m bench.paced_engine`, or `python -m
worker` with `--engine model`), A and B, in one group (one request partition each, default session
and transaction timeouts), `--kill-requests` requests, one reply topic of
`--kill-reply-partitions` (1) partitions that both write. A dies; B keeps streaming onto the same
reply partition, so what B's tokens wait behind A's open transaction is what a read_committed reader
of a fleet sees (B, or the broker's transaction timeout, ends it). Two modes, one run each:
`before-commit` (A SIGKILLs itself with a transaction open, the hook
INFERLINE_FAULT_KILL_BEFORE_COMMIT=`--kill-txn`: the worst case) and `sigkill` (this process
SIGKILLs A once `--kill-after` requests started: an open transaction only if the kill hits one).
Reports the longest hold a read_committed reader saw, when it ended, and the TTFT and gaps of B's
streams on the held partition meanwhile, per reader.

Prints a table, writes bench/results/read_committed.json (--out).
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.broker import broker_cpu, idle_cpu

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "read_committed.json"
# Scenario 1's delivery settings: `before` is what #36 found (tokens every 20 ms, a partition's
# next transaction as soon as the last commits); `after` is the settings as they are.
# `txn-1s`: the lever past the defaults, a partition's transaction at most once a second.
DELIVERY = {"before": {"flush_interval_ms": 20.0, "transaction_interval_ms": 0.0}, "after": {},
            "txn-1s": {"transaction_interval_ms": 1000.0}}
FLEET_RPS = 1e5  # the fleet #36 sizes the broker for
PROMPTS = ["Explain Kafka in one sentence.", "What is 2+2?", "Name a colour.", "Say hello.",
           "Write a haiku about the sea.", "What is the capital of France?", "Count to five.",
           "Why is the sky blue?"]


# ---- statistics (pure; tests/unit/test_bench_read_committed.py) -------------------------------------


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s) - 1e-9) - 1))
    return s[k]


def dist(values: list[float]) -> dict:
    return {"n": len(values), "p50": pct(values, 50), "p99": pct(values, 99),
            "max": max(values) if values else None, "mean": statistics.fmean(values) if values else None}


@dataclass
class Event:
    """One reply record as a reader saw it."""
    id: str
    attempt: str
    seq: int
    kind: str  # started | tokens | done | requeued (a done with finish_reason requeued)
    partition: int
    t: float  # monotonic arrival time at the reader


def per_request(submitted: dict[str, float], events: list[Event]) -> dict:
    """TTFT (submit -> first `tokens`) per request, and gaps between consecutive `tokens` events of
    one attempt, pooled over requests; `final_s` submit -> the request's final `done`."""
    ttft, gaps, final = [], [], []
    first: dict[str, float] = {}
    last: dict[tuple[str, str], float] = {}
    for ev in sorted(events, key=lambda e: e.t):
        if ev.id not in submitted:
            continue
        if ev.kind == "tokens":
            if ev.id not in first:
                first[ev.id] = ev.t
                ttft.append(ev.t - submitted[ev.id])
            key = (ev.id, ev.attempt)
            if key in last:
                gaps.append(ev.t - last[key])
            last[key] = ev.t
        elif ev.kind == "done":
            final.append(ev.t - submitted[ev.id])
    return {"ttft_s": dist(ttft), "gap_s": dist(gaps), "final_s": dist(final), "requests_with_tokens": len(first)}


def holds(uncommitted: list[Event], committed: list[Event]) -> dict:
    """Per event seen by both readers: committed arrival - uncommitted arrival (what read_committed
    adds to that event); events only the uncommitted reader saw (aborted ones) are counted."""
    seen = {(e.id, e.attempt, e.seq): e.t for e in uncommitted}
    both = {(e.id, e.attempt, e.seq): e for e in committed if (e.id, e.attempt, e.seq) in seen}
    lag = [max(0.0, e.t - seen[k]) for k, e in both.items()]
    worst = max(both.items(), key=lambda kv: kv[1].t - seen[kv[0]], default=None)
    out = {"hold_s": dist(lag), "only_uncommitted": len(set(seen) - {(e.id, e.attempt, e.seq) for e in committed})}
    if worst is not None:
        k, e = worst
        out["worst"] = {"id": k[0], "seq": k[2], "kind": e.kind, "partition": e.partition,
                        "uncommitted_t": seen[k], "committed_t": e.t}
    return out


def beside(submitted: dict[str, float], uncommitted: list[Event], committed: list[Event], partition: int,
           t0: float, t1: float) -> dict:
    """The streams that wrote to `partition` while it was held (t0..t1, as the uncommitted reader
    saw them): their TTFT and gaps per reader, what a read_committed client of a live stream sees."""
    ids = {e.id for e in uncommitted if e.partition == partition and t0 <= e.t <= t1 and e.kind == "tokens"}
    subset = {i: t for i, t in submitted.items() if i in ids}
    return {"requests": len(subset), "read_uncommitted": per_request(subset, uncommitted),
            "read_committed": per_request(subset, committed)}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def compare(unc: dict, com: dict) -> dict:
    """committed / uncommitted for the TTFT and gap percentiles."""
    return {f"{what}_{q}": ratio(com[what][q], unc[what][q]) for what in ("ttft_s", "gap_s") for q in ("p50", "p99")}


# ---- Kafka plumbing -------------------------------------------------------------------------------


class Reader:
    """Reads every partition of the reply topic from the start with the project client's consumer
    settings (producer/client.py) and the given isolation level; keeps every event and, when `raw`,
    every record (for the replay baseline)."""

    def __init__(self, settings, topic: str, isolation: str, raw: bool = False) -> None:
        from aiokafka import AIOKafkaConsumer

        self.topic, self.isolation, self.raw = topic, isolation, raw
        self.events: list[Event] = []
        self.records: list[tuple] = []  # (t, partition, key, value)
        self._c = AIOKafkaConsumer(**settings.kafka.connection_options(), group_id=None, enable_auto_commit=False,
                                   auto_offset_reset="earliest", isolation_level=isolation)
        self._task = None

    async def start(self, partitions: int) -> None:
        from aiokafka import TopicPartition

        await self._c.start()
        self._c.assign([TopicPartition(self.topic, p) for p in range(partitions)])
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        from inferline.contract.schema import DoneEvent, decode_event

        while True:
            batch = await self._c.getmany(timeout_ms=100)
            now = time.monotonic()
            for tp, records in batch.items():
                for r in records:
                    try:
                        ev = decode_event(r.value)
                    except Exception:  # noqa: BLE001 - not an event (the replay's warm-up record)
                        continue
                    kind = type(ev).__name__.removesuffix("Event").lower()
                    if isinstance(ev, DoneEvent) and ev.finish_reason == "requeued":
                        kind = "requeued"
                    self.events.append(Event(ev.id, ev.attempt, ev.seq, kind, tp.partition, now))
                    if self.raw:
                        self.records.append((now, tp.partition, r.key, r.value))

    def finals(self) -> set[str]:
        return {e.id for e in self.events if e.kind == "done"}

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._c.stop()


class RequestCounter:
    """The Kafka requests the worker's own clients send, by API (aiokafka's `AIOKafkaClient.send`,
    wrapped while the counter is open; the readers and the submitter have other client ids).
    What the broker handles is mostly per request, so this is its load without the CPU noise of a
    shared machine."""

    def __init__(self, client_id: str) -> None:
        self.client_id, self.counts = client_id, Counter()

    def __enter__(self) -> "RequestCounter":
        from aiokafka.client import AIOKafkaClient

        original = self._send = AIOKafkaClient.send

        async def send(client, node_id, request, **kw):
            if client._client_id == self.client_id:
                self.counts[type(request).__name__.rsplit("Request", 1)[0]] += 1
            return await original(client, node_id, request, **kw)

        AIOKafkaClient.send = send
        return self

    def __exit__(self, *exc) -> None:
        from aiokafka.client import AIOKafkaClient

        AIOKafkaClient.send = self._send


async def admin(settings, fn):
    from aiokafka.admin import AIOKafkaAdminClient

    a = AIOKafkaAdminClient(**settings.kafka.connection_options())
    await a.start()
    try:
        return await fn(a)
    finally:
        await a.close()


async def make_topics(settings, specs: list[tuple[str, int]]) -> None:
    from inferline.producer.topics import create_topics, topic_configs

    await admin(settings, lambda a: create_topics(a, specs, configs=topic_configs(3_600_000)))


async def drop_topics(settings, names: list[str]) -> None:
    try:
        await admin(settings, lambda a: a.delete_topics(names))
    except Exception as exc:  # noqa: BLE001 - cleanup only
        print(f"could not delete {names}: {exc!r}", file=sys.stderr)


@dataclass
class Run:
    prefix: str
    partitions: int
    requests: str = ""
    cancel: str = ""
    dlq: str = ""
    replies: str = ""
    group: str = ""
    submitted: dict = field(default_factory=dict)
    sent: list = field(default_factory=list)  # (t, key, value) request records, for the replay

    def __post_init__(self):
        self.requests, self.cancel, self.dlq = f"{self.prefix}.requests", f"{self.prefix}.cancel", f"{self.prefix}.dlq"
        self.replies, self.group = f"inferline.reply.{self.prefix}", f"{self.prefix}-workers"

    def specs(self) -> list[tuple[str, int]]:
        return [(self.requests, 2), (self.cancel, 1), (self.dlq, 1), (self.replies, self.partitions)]


def request_record(run: Run, i: int, max_tokens: int) -> tuple[bytes, bytes, str]:
    import msgpack

    rid = f"{run.prefix}-{i:03d}"
    body = {"v": 1, "id": rid, "reply_topic": run.replies, "prompt": PROMPTS[i % len(PROMPTS)] + f" ({i})",
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    return rid.encode(), msgpack.packb(body), rid


async def submit_all(settings, run: Run, n: int, max_tokens: int, rate: float, on_sent=None) -> None:
    from aiokafka import AIOKafkaProducer

    p = AIOKafkaProducer(**settings.kafka.connection_options(), enable_idempotence=True, acks="all")
    await p.start()
    try:
        start = time.monotonic()
        for i in range(n):
            if rate > 0:
                await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            key, value, rid = request_record(run, i, max_tokens)
            run.submitted[rid] = time.monotonic()
            run.sent.append((run.submitted[rid], key, value))
            await p.send_and_wait(run.requests, value, key=key)
            if on_sent:
                on_sent(i)
    finally:
        await p.stop()


async def wait_finals(readers: list[Reader], ids, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    want = set(ids)
    while time.monotonic() < deadline:
        if all(want <= r.finals() for r in readers):
            return True
        await asyncio.sleep(0.05)
    return False


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---- scenario 1: one in-process worker, two readers; the broker's CPU -------------------------------


def engine_for(s, runner, args):
    """The real model (`--engine model`) or the paced stand-in (bench/paced_engine.py)."""
    from bench.paced_engine import PacedEngine
    from inferline.worker.app import engine_settings
    from inferline.worker.engine.engine import LLMEngine

    if args.engine == "model":
        return LLMEngine(runner, engine_settings(s))
    return lambda: PacedEngine(args.step_ms / 1000, s.scheduler.max_num_seqs)


async def steady(settings, runner, args, delivery: dict, max_tokens: int, rate: float) -> dict:
    """One in-process worker under `delivery` (KafkaSettings overrides: a config of DELIVERY)."""
    from inferline.worker.app import Worker

    run = Run(f"rc-{uuid.uuid4().hex[:6]}", args.reply_partitions)
    await make_topics(settings, run.specs())
    k = settings.kafka.model_copy(update={"request_topic": run.requests, "cancel_topic": run.cancel,
                                          "dlq_topic": run.dlq, "group_id": run.group, **delivery})
    s = settings.model_copy(update={"kafka": k})
    worker = Worker(s, engine_for(s, runner, args))
    task = asyncio.create_task(worker.run())
    readers = [Reader(s, run.replies, "read_uncommitted", raw=True), Reader(s, run.replies, "read_committed")]
    try:
        await wait_ready(worker, task)
        for r in readers:
            await r.start(run.partitions)
        # Warm-up through the whole path (reply-topic metadata, first transaction of each partition).
        warm = Run(run.prefix + "w", run.partitions)
        warm.requests, warm.replies = run.requests, run.replies
        await submit_all(s, warm, 4, 2, 0)
        await wait_finals(readers, warm.submitted, 120)
        cpu_idle = await idle_cpu(args.idle_s)
        reg = worker.metrics.registry
        tx0 = (reg.get_sample_value("inferline_transactions_total", {"outcome": "committed"}) or 0,
               reg.get_sample_value("inferline_transaction_seconds_sum") or 0)
        l0, b0, t0 = load(), broker_cpu(), time.monotonic()
        with RequestCounter(k.client_id) as sent:
            await submit_all(s, run, args.num_requests, max_tokens, rate)
            ok = await wait_finals(readers, run.submitted, args.timeout)
        t1, b1 = time.monotonic(), broker_cpu()
        tx1 = (reg.get_sample_value("inferline_transactions_total", {"outcome": "committed"}) or 0,
               reg.get_sample_value("inferline_transaction_seconds_sum") or 0)
    finally:
        for r in readers:
            if r._task:
                await r.stop()
        worker.request_stop()
        await asyncio.wait_for(task, 60)
    unc, com = (per_request(run.submitted, r.events) for r in readers)
    span = t1 - t0
    ntx = tx1[0] - tx0[0]
    records = [rec for rec in readers[0].records if rec[0] >= t0 - 1e-3]
    out = {"complete": ok, "wall_s": span, "load_before": l0, "load_after": load(),
           "max_tokens": max_tokens, "rate": rate, "delivery": {"flush_interval_ms": k.flush_interval_ms, "transaction_interval_ms": k.transaction_interval_ms},
           "reply_records_per_request": len(records) / args.num_requests,
           "worker_kafka_requests_per_request": {api: n / args.num_requests for api, n in sorted(sent.counts.items())},
           "finals_per_transaction": args.num_requests / ntx if ntx else None,
           "read_uncommitted": unc, "read_committed": com, "committed_over_uncommitted": compare(unc, com),
           "holds": holds(readers[0].events, readers[1].events),
           "transactions": {"committed": ntx, "mean_open_ms": 1e3 * (tx1[1] - tx0[1]) / ntx if ntx else None},
           "broker_cpu_s": None if b0 is None or b1 is None else b1 - b0,
           "idle": {"window_s": args.idle_s, "broker_cpu_s": cpu_idle}}
    # The baseline replays these records: requests and every reply record the run produced.
    await drop_topics(settings, [t for t, _ in run.specs()])
    return out, run, records, t0


async def replay(settings, run: Run, records: list[tuple], t0: float, args, span: float) -> dict:
    """The baseline: the same request and reply records at the same relative times through one
    idempotent producer, no transaction, the same two readers attached."""
    from aiokafka import AIOKafkaProducer

    base = Run(f"rcb-{uuid.uuid4().hex[:6]}", run.partitions)
    await make_topics(settings, base.specs())
    readers = [Reader(settings, base.replies, "read_uncommitted"), Reader(settings, base.replies, "read_committed")]
    for r in readers:
        await r.start(base.partitions)
    p = AIOKafkaProducer(**settings.kafka.connection_options(), enable_idempotence=True, acks="all", linger_ms=5)
    await p.start()
    await p.send_and_wait(base.replies, b"", partition=0)  # metadata and connection, unmeasured; readers skip it
    await asyncio.sleep(1.0)
    cpu_idle = await idle_cpu(args.idle_s)
    plan = sorted([(t - t0, base.requests, None, k, v) for t, k, v in run.sent]
                  + [(t - t0, base.replies, part, k, v) for t, part, k, v in records], key=lambda x: x[0])
    l0, b0, start = load(), broker_cpu(), time.monotonic()
    futs = []
    for dt, topic, part, key, value in plan:
        await asyncio.sleep(max(0.0, start + dt - time.monotonic()))
        futs.append(await p.send(topic, value, key=key, partition=part))
    await asyncio.gather(*futs)
    # Let the readers fetch what was sent and the run last as long as the transactional one.
    await asyncio.sleep(max(0.2, start + span - time.monotonic()))
    b1 = broker_cpu()
    await p.stop()
    for r in readers:
        await r.stop()
    await drop_topics(settings, [t for t, _ in base.specs()])
    return {"records": len(plan), "reply_records": len(records), "wall_s": time.monotonic() - start,
            "load_before": l0, "load_after": load(),
            "broker_cpu_s": None if b0 is None or b1 is None else b1 - b0,
            "idle": {"window_s": args.idle_s, "broker_cpu_s": cpu_idle},
            "read_committed_events": len(readers[1].events)}


async def wait_ready(worker, task, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not (all(worker.readiness().values()) and worker.intake._consumer.assignment()):
        if task.done():
            task.result()
            raise RuntimeError("worker stopped before it was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker not ready: {worker.readiness()}")
        await asyncio.sleep(0.05)


# ---- scenario 2: a worker subprocess dies, another starts --------------------------------------------


def worker_env(settings, run: Run, port: int, extra: dict | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "INFERLINE_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "INFERLINE_KAFKA__REQUEST_TOPIC": run.requests, "INFERLINE_KAFKA__CANCEL_TOPIC": run.cancel,
        "INFERLINE_KAFKA__DLQ_TOPIC": run.dlq, "INFERLINE_KAFKA__GROUP_ID": run.group,
        "INFERLINE_KAFKA__TRANSACTION_TIMEOUT_MS": str(settings.kafka.transaction_timeout_ms),
        "INFERLINE_SCHEDULER__MAX_NUM_SEQS": str(settings.scheduler.max_num_seqs),
        "INFERLINE_HTTP__HOST": "127.0.0.1", "INFERLINE_HTTP__PORT": str(port),
        "INFERLINE_LOG__FORMAT": "json", "INFERLINE_WORKER__DRAIN_TIMEOUT_S": "10",
    })
    env.update(extra or {})
    return env


async def spawn_ready(env: dict, log: Path, module: str = "worker",
                      timeout: float = 300.0) -> tuple[subprocess.Popen, float]:
    from bench.kafka_e2e import http_get

    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", module], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    start = time.monotonic()
    port = int(env["INFERLINE_HTTP__PORT"])
    while (await asyncio.to_thread(http_get, port, "/readyz", 2.0))[0] != 200:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited {proc.returncode}: see {log}")
        if time.monotonic() - start > timeout:
            proc.kill()
            raise TimeoutError(f"worker not ready in {timeout:.0f} s: see {log}")
        await asyncio.sleep(0.2)
    return proc, time.monotonic()


async def killed(settings, args, mode: str) -> dict:
    """Workers A and B share the load (one request partition each) and the reply partitions; A
    dies, B keeps streaming onto the same reply partitions: what B's tokens wait behind A's
    open transaction is what a read_committed reader of a fleet sees."""
    from bench.kafka_e2e import free_port

    run = Run(f"rck-{uuid.uuid4().hex[:6]}", args.kill_reply_partitions)
    await make_topics(settings, run.specs())
    log = args.out.with_name(f"read_committed.{mode}.worker.log")
    log.unlink(missing_ok=True)
    extra = {"INFERLINE_FAULT_KILL_BEFORE_COMMIT": str(args.kill_txn)} if mode == "before-commit" else {}
    module = "worker" if args.engine == "model" else "bench.paced_engine"
    extra["INFERLINE_BENCH_STEP_MS"] = str(args.step_ms)
    (a, _), (b, _) = await asyncio.gather(spawn_ready(worker_env(settings, run, free_port(), extra), log, module),
                                          spawn_ready(worker_env(settings, run, free_port(), extra | {
                                              "INFERLINE_FAULT_KILL_BEFORE_COMMIT": "0"}), log, module))
    await asyncio.sleep(3.0)  # the group settles: one request partition each
    readers = [Reader(settings, run.replies, "read_uncommitted"), Reader(settings, run.replies, "read_committed")]
    n = args.kill_requests
    try:
        for r in readers:
            await r.start(run.partitions)
        submitter = asyncio.create_task(submit_all(settings, run, n, args.max_tokens[0], args.rate[0]))
        if mode == "sigkill":
            while len({e.id for e in readers[0].events if e.kind == "started" and e.id in run.submitted}) < args.kill_after:
                await asyncio.sleep(0.01)
            a.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + args.timeout
        while a.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker A did not die ({mode})")
            await asyncio.sleep(0.01)
        killed_t = time.monotonic()
        started_before = len({e.id for e in readers[0].events if e.kind == "started" and e.id in run.submitted})
        await submitter
        # A second wave once A is dead: what lands on B's request partition streams at once onto
        # the shared reply partitions, behind A's open transaction until B or the broker aborts it.
        wave = Run(run.prefix + "x", run.partitions)
        wave.requests, wave.replies = run.requests, run.replies
        await submit_all(settings, wave, n, args.max_tokens[0], args.rate[0])
        run.submitted.update(wave.submitted)
        ok = await wait_finals(readers, run.submitted, args.timeout)
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        for r in readers:
            if r._task:
                await r.stop()
    h = holds(readers[0].events, readers[1].events)
    worst = h.get("worst")
    if worst:
        worst["ended_after_kill_s"] = worst["committed_t"] - killed_t
        h["beside"] = beside(run.submitted, *(r.events for r in readers), worst["partition"], killed_t,
                             worst["committed_t"])
    unc, com = (per_request(run.submitted, r.events) for r in readers)
    await drop_topics(settings, [t for t, _ in run.specs()])
    return {"mode": mode, "requests": 2 * n, "complete": ok, "started_before_kill": started_before,
            "transaction_timeout_ms": settings.kafka.transaction_timeout_ms,
            "session_timeout_ms": settings.kafka.session_timeout_ms, "holds": h, "load_after": load(),
            "read_uncommitted": unc, "read_committed": com, "worker_log": str(log)}


# ---- report -----------------------------------------------------------------------------------------


def ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}"


def fx(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def print_report(res: dict) -> None:
    print(f"\n{res['settings']}  CPU: {res['cpu_model']}")
    for name, block in res.get("delivery", {}).items():
        print_steady(name, block, res["settings"]["num_requests"])
    rows = [(name, b["broker_cpu"]) for name, b in res.get("delivery", {}).items()]
    if rows:
        print("\nbroker CPU-ms per request, raw / net of an idle window (transactional: the worker as configured;"
              " replay: its records again, idempotent producer, no transaction, no group)")
        for name, cpu in rows:
            t, b = cpu["transactional"], cpu["baseline"]
            print(f"  {name:<12} transactional {fx(t['per_request_ms'])} / {fx(t['per_request_net_ms'])}   "
                  f"replay {fx(b['per_request_ms'])} / {fx(b['per_request_net_ms'])}   "
                  f"ratio raw x{fx(cpu['ratio_raw'])}, net x{fx(cpu['ratio_net'])}   "
                  f"at {FLEET_RPS:.0e} requests/s: {fleet_cores(t['per_request_ms'])} broker cores (raw)")
        cpus = dict(rows)
        first_rate = f"@{res['settings']['rate'][0]:g}"
        for b, cb in rows:  # each config against `before` of the same length and rate, each rate against the first
            at = b.rsplit("@", 1)
            for a in ("before" + b[len(config_of(b)):], at[0] + first_rate if len(at) == 2 else b):
                ca = cpus.get(a)
                if ca is None or a == b:
                    continue
                print(f"  {b} / {a}: transactional raw x{fx(ratio(cb['transactional']['per_request_ms'], ca['transactional']['per_request_ms']))}"
                      f", net x{fx(ratio(cb['transactional']['per_request_net_ms'], ca['transactional']['per_request_net_ms']))}")
    print_killed(res)


def print_steady(name: str, block: dict, n: int) -> None:
    s = block["steady"]
    d = s["delivery"]
    print(f"\nscenario 1, {name} (flush {d['flush_interval_ms']:g} ms, transaction interval "
          f"{d['transaction_interval_ms']:g} ms): {n} requests, complete {s['complete']}, load {s['load_before']} -> "
          f"{s['load_after']}, {s['transactions']['committed']:.0f} transactions ({fx(s['finals_per_transaction'])} finals"
          f" each, open {fx(s['transactions']['mean_open_ms'])} ms), {fx(s['reply_records_per_request'])} reply records"
          f" per request")
    head = f"{'reader':<18}{'TTFT p50':>9}{'p99':>7}{'gap p50':>9}{'p99':>7}{'max':>7}{'final p50':>10}"
    print(head + "  (ms)\n" + "-" * len(head))
    for reader in ("read_uncommitted", "read_committed"):
        r = s[reader]
        print(f"{reader:<18}{ms(r['ttft_s']['p50']):>9}{ms(r['ttft_s']['p99']):>7}{ms(r['gap_s']['p50']):>9}"
              f"{ms(r['gap_s']['p99']):>7}{ms(r['gap_s']['max']):>7}{ms(r['final_s']['p50']):>10}")
    c = s["committed_over_uncommitted"]
    print(f"{'committed/uncomm.':<18}{fx(c['ttft_s_p50']):>9}{fx(c['ttft_s_p99']):>7}{fx(c['gap_s_p50']):>9}{fx(c['gap_s_p99']):>7}")
    sent = s.get("worker_kafka_requests_per_request", {})
    print(f"the worker's Kafka requests per served request: {sum(sent.values()):.2f} ("
          + ", ".join(f"{api} {v:.2f}" for api, v in sorted(sent.items(), key=lambda kv: -kv[1])) + ")")
    hd = s["holds"]["hold_s"]
    print(f"hold per event (committed - uncommitted arrival): p50 {ms(hd['p50'])} ms, p99 {ms(hd['p99'])} ms, "
          f"max {ms(hd['max'])} ms over {hd['n']} events")


def print_killed(res: dict) -> None:
    for k in res.get("killed", []):
        if "error" in k:
            print(f"\nscenario 2 ({k['mode']}): failed: {k['error']} (load {k['load_after']})")
            continue
        w = k["holds"].get("worst", {})
        print(f"\nscenario 2 ({k['mode']}): {k['requests']} requests on workers A and B (half after A died), complete {k['complete']}, "
              f"{k['started_before_kill']} started before A died, load {k['load_after']}")
        print(f"  read_committed longest hold {ms(k['holds']['hold_s']['max'])} ms (p99 {ms(k['holds']['hold_s']['p99'])});"
              f" it ended {fx(w.get('ended_after_kill_s'))} s after A died; events only read_uncommitted saw: {k['holds']['only_uncommitted']}")
        print(f"  TTFT p99 uncommitted {ms(k['read_uncommitted']['ttft_s']['p99'])} / committed "
              f"{ms(k['read_committed']['ttft_s']['p99'])} ms; gap max {ms(k['read_uncommitted']['gap_s']['max'])} / "
              f"{ms(k['read_committed']['gap_s']['max'])} ms")
        bs = k["holds"].get("beside")
        if bs:
            u, c = bs["read_uncommitted"], bs["read_committed"]
            print(f"  live streams on the held partition {w.get('partition')} meanwhile: {bs['requests']} requests; "
                  f"TTFT p50/max uncommitted {ms(u['ttft_s']['p50'])}/{ms(u['ttft_s']['max'])} ms, committed "
                  f"{ms(c['ttft_s']['p50'])}/{ms(c['ttft_s']['max'])} ms; gap max {ms(u['gap_s']['max'])} / "
                  f"{ms(c['gap_s']['max'])} ms; final p50 {ms(u['final_s']['p50'])} / {ms(c['final_s']['p50'])} ms")


def fleet_cores(per_request_ms: float | None) -> str:
    """The broker cores a fleet at FLEET_RPS would spend at this CPU per request, linearly."""
    return "-" if per_request_ms is None else f"{FLEET_RPS * per_request_ms / 1e3:,.0f}"


def cpu_rows(steady_res: dict, base: dict, n: int) -> dict:
    def row(r, what):
        raw, idle = r["broker_cpu_s"], r["idle"]["broker_cpu_s"]
        net = None if raw is None or idle is None else raw - idle * r["wall_s"] / r["idle"]["window_s"]
        return {"broker_cpu_s": raw, "idle_scaled_s": None if idle is None else idle * r["wall_s"] / r["idle"]["window_s"],
                "per_request_ms": None if raw is None else 1e3 * raw / n,
                "per_request_net_ms": None if net is None else 1e3 * net / n, "what": what}

    t = row(steady_res, "group mode as is: worker, transactions, two readers")
    b = row(base, "same records replayed, idempotent producer, no transaction, no group, two readers")
    return {"transactional": t, "baseline": b, "ratio_raw": ratio(t["per_request_ms"], b["per_request_ms"]),
            "ratio_net": ratio(t["per_request_net_ms"], b["per_request_net_ms"])}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


# ---- main ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.read_committed", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--max-tokens", type=lambda v: [int(x) for x in v.split(",")], default=[48],
                   help="each request's tokens; a list (48,256) runs scenario 1 once per length and config")
    p.add_argument("--rate", type=lambda v: [float(x) for x in v.split(",")], default=[20.0],
                   help="requests submitted per second (0: all at once); a list (20,80) runs scenario 1 per rate")
    p.add_argument("--engine", choices=("paced", "model"), default="paced",
                   help="paced: bench/paced_engine.py, a token per request every --step-ms; model: the real model")
    p.add_argument("--step-ms", type=float, default=25.0, help="the paced engine's step time")
    p.add_argument("--delivery", default="before,after",
                   help="scenario 1 runs, in this order: " + "; ".join(f"{k}: {v or 'the settings as they are'}"
                                                                      for k, v in DELIVERY.items()))
    p.add_argument("--reply-partitions", type=int, default=4)
    p.add_argument("--kill-reply-partitions", type=int, default=1,
                   help="scenario 2's reply partitions (1: every live stream shares the dead worker's)")
    p.add_argument("--idle-s", type=float, default=10.0, help="idle window for the broker's background CPU")
    p.add_argument("--kill-requests", type=int, default=12, help="requests of each scenario-2 run")
    p.add_argument("--kill-after", type=int, default=8, help="sigkill: requests started before the kill")
    p.add_argument("--kill-txn", type=int, default=1, help="before-commit: die in this transaction")
    p.add_argument("--kill-modes", default="before-commit,sigkill")
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="measure from the first run (else the first config runs once unmeasured)")
    p.add_argument("--no-kill", action="store_true")
    p.add_argument("--only-kill", action="store_true", help="scenario 2 only")
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def config_of(name: str) -> str:
    """The delivery config of a run's name ("after/256@80" -> "after")."""
    return re.split("[/@]", name)[0]


def configs(args) -> list[tuple[str, int, float]]:
    """Scenario 1's runs: (name, max_tokens, rate) per delivery config, stream length and rate,
    the length and the rate in the name when there are several."""
    names = [c for c in args.delivery.split(",") if c]
    out = []
    for rate in args.rate:
        for mt in args.max_tokens:
            for name in names:
                tail = (f"/{mt}" if len(args.max_tokens) > 1 else "") + (f"@{rate:g}" if len(args.rate) > 1 else "")
                out.append((name + tail, mt, rate))
    return out


async def amain(args, settings, runner) -> dict:
    res = {"settings": {"num_requests": args.num_requests, "max_tokens": args.max_tokens, "rate": args.rate,
                        "reply_partitions": args.reply_partitions, "engine": args.engine,
                        "step_ms": args.step_ms if args.engine == "paced" else None,
                        "transaction_timeout_ms": settings.kafka.transaction_timeout_ms},
           "cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "load_at_start": load()}
    if not args.only_kill:
        res["delivery"] = {}
        if args.warm_up:  # a fresh broker JVM spends more per request until its code is compiled
            name, mt, rate = configs(args)[0]
            await steady(settings, runner, args, DELIVERY[config_of(name)], mt, rate)
        for name, mt, rate in configs(args):
            steady_res, run, records, t0 = await steady(settings, runner, args, DELIVERY[config_of(name)], mt, rate)
            base = await replay(settings, run, records, t0, args, steady_res["wall_s"])
            res["delivery"][name] = {"steady": steady_res, "baseline": base,
                                     "broker_cpu": cpu_rows(steady_res, base, args.num_requests)}
    if not args.no_kill:
        res["killed"] = []
        for mode in (m for m in args.kill_modes.split(",") if m):
            try:
                res["killed"].append(await killed(settings, args, mode))
            except Exception as exc:  # noqa: BLE001 - scenario 1 is reported whatever happens here
                res["killed"].append({"mode": mode, "error": repr(exc), "load_after": load()})
    return res


def main(argv=None) -> dict:
    args = parse_args(argv)
    from bench.broker import acquire_broker, release_broker
    from bench.kafka_e2e import save
    from bench.roofline import in_thread
    from inferline.config.settings import load_settings
    from inferline.worker.engine.model_runner import ModelRunner

    started = time.time()
    settings = load_settings()
    sched = settings.scheduler.model_copy(update={"max_num_seqs": max(args.num_requests, 8)})
    settings = settings.model_copy(update={"scheduler": sched})
    leased = acquire_broker(settings)
    try:
        runner = None if args.only_kill or args.engine != "model" else in_thread(lambda: ModelRunner(settings))
        res = asyncio.run(amain(args, settings, runner))
    finally:
        if leased:
            release_broker()
    res["command"] = "python -m bench.read_committed " + " ".join(argv if argv is not None else sys.argv[1:])
    return save(res, args.out, started, print_report)


if __name__ == "__main__":
    main()
