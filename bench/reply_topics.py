"""Producer metadata with many reply topics (issue #26 item 5): the worker's, pruned, against a
plain producer's, which keeps every topic it ever wrote to.

    python -m bench.reply_topics                  # 10,000 reply topics, one request each
    python -m bench.reply_topics --topics 600     # quick: just past MAX_PRODUCER_TOPICS (the test)

One command, on a private broker of its own (tests.chaos_fixtures.PrivateBroker: scripts/kafka.sh
on a free port with a temporary data dir, stopped and removed at the end; the shared broker on
9092 is never touched):

1. creates N reply topics (1 partition each, `inferline.reply.bench-<stem>-<i>`) in batches with
   aiokafka's admin client, plus an input topic, a dead-letter topic and a warm-up reply topic,
   and waits until the broker leads every new partition;
2. (a) `worker`: the worker's own Publisher and Transactions (worker/delivery/publisher.py,
   worker/delivery/transactions.py) send, per topic, one request's events as worker/app.py does:
   `started`, `tokens`, then the final `done` committed with its input offset in the input
   partition's transaction (one partition opened, offsets tracked by a real OffsetTracker);
3. (b) `baseline`: one plain idempotent AIOKafkaProducer sends the same three events per topic
   (as the worker did before transactions and pruning).

At most --concurrency requests are in flight at a time (a worker runs a bounded batch); one
untimed warm-up request goes first. Each variant runs in a child process of its own, so that its
RSS growth is its own. Reports per variant: the producer's metadata topic set at the end
(`client._topics`, where empty means every topic of the cluster; for (a) the Publisher's producer
and the partition's transactional producer) and the topics a refresh fetches, the time of one
metadata refresh at the end, the metadata requests made (count, all-topic ones, topics fetched,
seconds), send time and events/s (overall, first and last 10% of requests), RSS growth, and
aiokafka's warnings by error. Prints a table; writes bench/results/reply-topics.json (--out).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "reply-topics.json"
EVENTS_PER_REQUEST = 3  # started, tokens, done
REFRESHES = 3  # metadata refreshes timed at the end (median reported)
# Open files the broker needs besides one per partition's active segment (sockets, jars,
# internal topics' segments).
BROKER_SPARE_FDS = 2_000
# A run with no request finished for this long is stuck: it says where, and fails.
STALL_S = 120.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.reply_topics", description=__doc__.split("\n")[0])
    p.add_argument("--topics", type=int, default=10_000, help="reply topics, one request each (default 10000)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at a time (default 64)")
    p.add_argument("--create-batch", type=int, default=500, help="topics per CreateTopics request")
    p.add_argument("--order", choices=["worker,baseline", "baseline,worker"], default="worker,baseline")
    p.add_argument("--heap", default=None, help="broker JVM heap flags (default: grows with --topics)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--no-progress", action="store_true")
    # A child process runs one variant against the parent's broker and topics.
    p.add_argument("--variant", choices=["worker", "baseline"], help=argparse.SUPPRESS)
    p.add_argument("--bootstrap", help=argparse.SUPPRESS)
    p.add_argument("--stem", help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.topics < 1 or args.concurrency < 1 or args.create_batch < 1:
        p.error("--topics, --concurrency and --create-batch must be positive")
    return args


class Names:
    def __init__(self, stem: str) -> None:
        self.stem = stem
        self.requests = f"bench-reply-topics-{stem}.requests"
        self.dlq = f"bench-reply-topics-{stem}.dlq"
        self.group = f"bench-reply-topics-{stem}"

        # One request goes here first: the broker's first transaction and offset commit (its
        # internal topics) and the producers' start-up are not timed.
        self.warmup = f"inferline.reply.bench-{stem}-warmup"

    def reply(self, i: int) -> str:
        return f"inferline.reply.bench-{self.stem}-{i:05d}"


def rss_mb() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(rest.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def settings_for(bootstrap: str, names: Names):
    from inferline.config.settings import Settings

    return Settings(kafka={"bootstrap_servers": bootstrap, "request_topic": names.requests,
                           "dlq_topic": names.dlq, "group_id": names.group, "client_id": "bench-reply-topics"})


METADATA: dict[int, dict] = {}  # id(client) -> its metadata requests, from its first one


def count_metadata_requests() -> None:
    """Counts every client's metadata requests from its start: how many, how many asked for every
    topic of the cluster (aiokafka asks for all while its topic set is empty), the topics that
    came back, and the seconds spent."""
    from aiokafka.client import AIOKafkaClient

    inner = AIOKafkaClient._metadata_update

    async def counted(self, cluster, topics):
        stats = METADATA.setdefault(id(self), {"requests": 0, "all_topics_requests": 0, "topics_fetched": 0,
                                               "seconds": 0.0})
        t0 = time.perf_counter()
        try:
            return await inner(self, cluster, topics)
        finally:
            stats["requests"] += 1
            stats["all_topics_requests"] += not topics
            stats["topics_fetched"] += len(cluster.topics())
            stats["seconds"] += time.perf_counter() - t0

    AIOKafkaClient._metadata_update = counted


async def refresh_s(client) -> float:
    """Median time of a metadata refresh of everything this client tracks."""
    times = []
    for _ in range(REFRESHES):
        t0 = time.perf_counter()
        await client.force_metadata_update()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def metadata_report(client, refresh: float) -> dict:
    """`topics`: the client's topic set (empty: every topic of the cluster); `cached_topics`: the
    topics whose metadata the last refresh brought (what each refresh costs)."""
    stats = METADATA.get(id(client), {})
    return {"topics": len(client._topics), "cached_topics": len(client.cluster.topics()), "refresh_s": refresh,
            **{f"metadata_{k}": v for k, v in stats.items()}}


def events(i: int):
    """One request's three events, as the worker encodes them."""
    from inferline.contract.schema import DoneEvent, StartedEvent, Timing, TokensEvent, Usage, encode_event

    rid, attempt = f"bench-{i}", uuid.uuid4().hex
    return rid, [
        encode_event(StartedEvent(id=rid, attempt=attempt, seq=0, worker="bench", queue_s=0.001)),
        encode_event(TokensEvent(id=rid, attempt=attempt, seq=1, token_ids=[42, 43], text="ok")),
        encode_event(DoneEvent(id=rid, attempt=attempt, seq=2, finish_reason="length",
                               usage=Usage(prompt_tokens=3, completion_tokens=2),
                               timing=Timing(queue_s=0.001, ttft_s=0.002, total_s=0.003), text="ok")),
    ]


class Clock:
    """Completion times of requests, for overall and first / last 10% rates, and progress lines."""

    def __init__(self, label: str, n: int, progress: bool) -> None:
        self.label, self.n, self.progress = label, n, progress
        self.t0 = time.perf_counter()
        self.done_at: list[float] = []
        self.outcomes: dict[str, int] = {}
        self.finished = asyncio.Event()

    def done(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self.done_at.append(time.perf_counter() - self.t0)
        k = len(self.done_at)
        if self.progress and (k % max(1, self.n // 10) == 0 or k == self.n):
            print(f"  {self.label}: {k}/{self.n} requests ({self.done_at[-1]:.1f} s)", file=sys.stderr, flush=True)
        if k == self.n:
            self.finished.set()

    async def watch(self, describe) -> None:
        """Fails the run when no request finishes for STALL_S, saying what is still pending."""
        seen = -1
        while not self.finished.is_set():
            seen = len(self.done_at)
            await asyncio.sleep(STALL_S)
            if len(self.done_at) == seen and not self.finished.is_set():
                print(f"  {self.label}: stuck at {seen}/{self.n} requests for {STALL_S:.0f} s: {describe()}",
                      file=sys.stderr, flush=True)
                os._exit(3)

    def report(self) -> dict:
        n, t = len(self.done_at), self.done_at
        tenth = max(1, n // 10)
        first = tenth * EVENTS_PER_REQUEST / t[tenth - 1] if t[tenth - 1] > 0 else None
        span = t[-1] - t[n - tenth - 1] if n > tenth else t[-1]
        last = tenth * EVENTS_PER_REQUEST / span if span > 0 else None
        return {"requests": n, "events": n * EVENTS_PER_REQUEST, "outcomes": self.outcomes, "send_s": t[-1],
                "events_per_s": n * EVENTS_PER_REQUEST / t[-1], "first_10pct_events_per_s": first,
                "last_10pct_events_per_s": last}


# ---- the variants (each in a child process) --------------------------------------------------------


async def run_worker(args, names: Names) -> dict:
    """The worker's Publisher and Transactions, called as worker/app.py calls them."""
    from aiokafka import TopicPartition

    from inferline.worker.service.metrics import Metrics
    from inferline.worker.delivery.offsets import OffsetTracker
    from inferline.worker.delivery.publisher import Publisher, ReplyStream
    from inferline.worker.delivery.transactions import Transactions

    settings = settings_for(args.bootstrap, names)
    metrics, tracker = Metrics(), OffsetTracker()
    transactions = Transactions(settings, tracker, metrics)
    publisher = Publisher(settings, metrics, "bench-worker", transactions)
    tp = TopicPartition(names.requests, 0)
    await publisher.start()
    await transactions.open([tp])
    txn_client = transactions._parts[tp]._producer.client
    pub_client = publisher._producer.client

    def request(i: int, topic: str, on_acked) -> None:
        offset = i + 1  # offset 0: the warm-up
        tracker.add(tp, offset)
        tracker.watermark(tp)  # the intake's lag gauge does this after every fetch
        rs = ReplyStream(f"bench-{i}", uuid.uuid4().hex, topic, None)
        publisher.started(rs, 0.001)
        publisher.tokens(rs, [42, 43], "ok")
        publisher.done(rs, finish_reason="length", prompt_tokens=3, completion_tokens=2, queue_s=0.001,
                       ttft_s=0.002, total_s=0.003, text="ok", source=(tp, offset, 0), on_acked=on_acked)

    warm = asyncio.get_running_loop().create_future()
    request(-1, names.warmup, lambda outcome, error=None: warm.set_result(outcome))
    if await warm != "ok":
        raise RuntimeError(f"the warm-up request failed: {warm.result()}")
    rss0, _ = rss_mb()
    clock = Clock("worker", args.topics, not args.no_progress)
    slots = asyncio.Semaphore(args.concurrency)

    def acked(outcome: str, error: str | None = None) -> None:
        slots.release()
        clock.done(outcome)

    def describe() -> str:
        part = transactions._parts[tp]
        return (f"publisher backlog {publisher.backlog}, lanes {len(publisher._lanes)}, "
                f"failing {len(publisher._failing)}, txn queue {len(part._queue)} "
                f"(tries {sorted(f.tries for f in part._queue)[-5:]}), committing {len(part._committing)}, "
                f"fenced {part.fenced}, tracker pending {tracker.pending(tp)}")

    watchdog = asyncio.create_task(clock.watch(describe))

    for i in range(args.topics):
        await slots.acquire()
        request(i, names.reply(i), acked)
    await clock.finished.wait()
    watchdog.cancel()
    report = clock.report()
    rss1, hwm = rss_mb()
    report.update(
        publisher_producer=metadata_report(pub_client, await refresh_s(pub_client)),
        transactional_producer=metadata_report(txn_client, await refresh_s(txn_client)),
        send_failures=metrics.send_failures._value.get(), rss_start_mb=rss0, rss_end_mb=rss1,
        rss_growth_mb=rss1 - rss0, rss_peak_mb=hwm)
    await publisher.stop()
    await transactions.close_all()
    return report


async def run_baseline(args, names: Names) -> dict:
    """One plain idempotent producer for every event, no pruning: the worker before."""
    from aiokafka import AIOKafkaProducer


    kafka = settings_for(args.bootstrap, names).kafka
    producer = AIOKafkaProducer(**kafka.client_options(), enable_idempotence=True, acks="all", linger_ms=5,
                                max_request_size=kafka.max_message_bytes + 64 * 1024)
    await producer.start()
    _, warmup = events(-1)
    await asyncio.gather(*[await producer.send(names.warmup, v, key=b"bench--1") for v in warmup])
    rss0, _ = rss_mb()
    clock = Clock("baseline", args.topics, not args.no_progress)
    slots = asyncio.Semaphore(args.concurrency)
    tasks = set()

    async def request(i: int) -> None:
        rid, values = events(i)
        try:
            futs = [await producer.send(names.reply(i), v, key=rid.encode()) for v in values]
            await asyncio.gather(*futs)
            outcome = "ok"
        except Exception:  # noqa: BLE001 - counted in the outcomes
            outcome = "failed"
        slots.release()
        clock.done(outcome)

    watchdog = asyncio.create_task(clock.watch(lambda: f"{len(tasks)} requests in flight"))
    for i in range(args.topics):
        await slots.acquire()
        task = asyncio.create_task(request(i))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await clock.finished.wait()
    watchdog.cancel()
    report = clock.report()
    rss1, hwm = rss_mb()
    report.update(producer=metadata_report(producer.client, await refresh_s(producer.client)),
                  rss_start_mb=rss0, rss_end_mb=rss1, rss_growth_mb=rss1 - rss0, rss_peak_mb=hwm)
    await producer.stop()
    return report


class CountWarnings(logging.Handler):
    """Counts aiokafka's warnings by error class instead of printing one line per retried batch."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        key = msg.rsplit("<class '", 1)[-1].rstrip("'>").rsplit(".", 1)[-1] if "<class '" in msg else msg[:80]
        self.counts[key] = self.counts.get(key, 0) + 1


def child_main(args) -> None:
    count_metadata_requests()
    counter = CountWarnings()
    logging.getLogger("aiokafka").addHandler(counter)
    logging.getLogger("aiokafka").propagate = False
    names = Names(args.stem)
    fn = run_worker if args.variant == "worker" else run_baseline
    report = asyncio.run(fn(args, names))
    report["aiokafka_warnings"] = counter.counts
    args.child_out.write_text(json.dumps(report))


# ---- the parent: broker, topics, both variants, the report -------------------------------------------


def default_heap(topics: int) -> str:
    # The broker keeps per-partition state on the heap; the default 384-512 MiB is sized for tests.
    return f"-Xmx{512 + topics // 10}m -Xms256m"


def check_open_files(topics: int) -> dict:
    """The broker (our child) keeps each partition's active segment open: it needs an fd each."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = topics + BROKER_SPARE_FDS
    if soft < need <= hard or (soft < need and hard == resource.RLIM_INFINITY):
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        soft = need
    if soft < need:
        raise SystemExit(f"ulimit -n is {soft} (hard {hard}): a broker with {topics} partitions needs about "
                         f"{need}; the most this machine allows is --topics {max(0, hard - BROKER_SPARE_FDS)}")
    return {"nofile_soft": soft, "nofile_hard": hard, "needed": need}


async def create_all(bootstrap: str, names: Names, n: int, batch: int, progress: bool) -> float:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=300_000)
    await admin.start()
    t0 = time.perf_counter()
    try:
        await admin.create_topics([NewTopic(t, 1, 1) for t in (names.requests, names.dlq, names.warmup)])
        for start in range(0, n, batch):
            todo = [NewTopic(names.reply(i), 1, 1) for i in range(start, min(n, start + batch))]
            resp = await admin.create_topics(todo, timeout_ms=300_000)
            errors = [e for e in getattr(resp, "topic_errors", []) if e[1] != 0]
            if errors:
                raise RuntimeError(f"creating topics failed: {errors[:3]}")
            if progress:
                print(f"created {min(n, start + batch)}/{n} reply topics ({time.perf_counter() - t0:.1f} s)",
                      file=sys.stderr, flush=True)
    finally:
        await admin.close()
    return time.perf_counter() - t0


async def end_offsets(bootstrap: str, names: Names, n: int, timeout_ms: int = 40_000) -> dict:
    """Each reply topic's high watermark: what both variants wrote (the worker's `done` also
    leaves a transaction marker)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                                request_timeout_ms=timeout_ms)
    await consumer.start()
    tps = [TopicPartition(names.reply(i), 0) for i in range(n)]
    try:
        # Assigned first, so one metadata request covers every topic: end_offsets alone learns
        # one unknown topic per metadata round trip.
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
    values = list(ends.values())
    return {"min": min(values), "max": max(values)}


def run_child(variant: str, args, bootstrap: str, stem: str, kdir: Path) -> dict:
    out = kdir / f"{variant}.json"
    cmd = [sys.executable, "-m", "bench.reply_topics", "--variant", variant, "--bootstrap", bootstrap,
           "--stem", stem, "--topics", str(args.topics), "--concurrency", str(args.concurrency),
           "--child-out", str(out)]
    if args.no_progress:
        cmd.append("--no-progress")
    done = subprocess.run(cmd, cwd=REPO, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {variant} run failed (exit {done.returncode})")
    return json.loads(out.read_text())


def machine_info() -> dict:
    import aiokafka

    cpu = None
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        cpu = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), None)
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "aiokafka": aiokafka.__version__, "loadavg_at_start": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def fmt(x, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def table(results: dict) -> str:
    w, b = results["runs"]["worker"], results["runs"]["baseline"]
    pub, txn, base = w["publisher_producer"], w["transactional_producer"], b["producer"]

    def both(key: str, f=str) -> str:
        return f"{f(pub.get(key))} + txn {f(txn.get(key))}"

    def topics(md: dict) -> str:
        return f"{md['topics']}" if md["topics"] else "all"  # aiokafka: an empty set means every topic

    rows = [
        ("requests / events", f"{w['requests']} / {w['events']}", f"{b['requests']} / {b['events']}"),
        ("outcomes", json.dumps(w["outcomes"]), json.dumps(b["outcomes"])),
        ("producer topic set", f"{topics(pub)} + txn {topics(txn)}", topics(base)),
        ("topics a refresh fetches (end)", both("cached_topics"), f"{base['cached_topics']}"),
        ("metadata refresh at end (ms)", both("refresh_s", lambda x: f"{x * 1e3:.1f}"),
         f"{base['refresh_s'] * 1e3:.1f}"),
        ("metadata requests (all-topic ones)",
         f"{pub['metadata_requests']} ({pub['metadata_all_topics_requests']}) + txn {txn['metadata_requests']} "
         f"({txn['metadata_all_topics_requests']})",
         f"{base['metadata_requests']} ({base['metadata_all_topics_requests']})"),
        ("  topics fetched, total", both("metadata_topics_fetched"), f"{base['metadata_topics_fetched']}"),
        ("  seconds in them", both("metadata_seconds", lambda x: f"{x:.1f}"), f"{base['metadata_seconds']:.1f}"),
        ("send time (s)", f"{w['send_s']:.1f}", f"{b['send_s']:.1f}"),
        ("events/s", fmt(w["events_per_s"]), fmt(b["events_per_s"])),
        ("events/s, first 10% / last 10%",
         f"{fmt(w['first_10pct_events_per_s'])} / {fmt(w['last_10pct_events_per_s'])}",
         f"{fmt(b['first_10pct_events_per_s'])} / {fmt(b['last_10pct_events_per_s'])}"),
        ("RSS growth (MiB)", f"{w['rss_growth_mb']:.1f}", f"{b['rss_growth_mb']:.1f}"),
        ("RSS peak (MiB)", f"{w['rss_peak_mb']:.1f}", f"{b['rss_peak_mb']:.1f}"),
        ("aiokafka warnings", json.dumps(w["aiokafka_warnings"]), json.dumps(b["aiokafka_warnings"])),
    ]
    head = ("", "(a) worker (pruned)", "(b) plain producer")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    return "\n".join("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in [head, *rows])


def _stop_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # runs the `finally` that stops the private broker


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.variant:
        child_main(args)
        return None
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    from tests.chaos_fixtures import PrivateBroker

    progress = not args.no_progress
    results = {"command": "python -m bench.reply_topics " + " ".join(argv if argv is not None else sys.argv[1:]),
               "machine": machine_info(),
               "settings": {"topics": args.topics, "concurrency": args.concurrency, "order": args.order}}
    from inferline.worker.delivery.transactions import MAX_PRODUCER_TOPICS

    results["settings"]["max_producer_topics"] = MAX_PRODUCER_TOPICS
    results["open_files"] = check_open_files(args.topics)
    heap = args.heap or default_heap(args.topics)
    kdir = Path(tempfile.mkdtemp(prefix="inferline-bench-reply-topics-"))
    broker = PrivateBroker(kdir, heap=heap)
    names = Names(uuid.uuid4().hex[:8])
    try:
        t0 = time.perf_counter()
        broker.start()
        results["broker"] = {"bootstrap": broker.bootstrap, "heap": heap, "start_s": time.perf_counter() - t0}
        if progress:
            print(f"private broker on {broker.bootstrap} ({heap}); creating {args.topics} reply topics",
                  file=sys.stderr, flush=True)
        results["broker"]["create_topics_s"] = asyncio.run(
            create_all(broker.bootstrap, names, args.topics, args.create_batch, progress))
        # CreateTopics returns before the broker leads the new partitions: wait until every one
        # answers, so that neither run pays for the broker's start-up. (aiokafka logs each
        # topic it does not know yet as an error meanwhile.)
        t0 = time.perf_counter()
        logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
        asyncio.run(end_offsets(broker.bootstrap, names, args.topics, timeout_ms=600_000))
        logging.getLogger("aiokafka").setLevel(logging.NOTSET)
        results["broker"]["topics_ready_s"] = time.perf_counter() - t0
        results["runs"] = {}
        for variant in args.order.split(","):
            if progress:
                print(f"{variant}: {args.topics} requests, {args.concurrency} in flight", file=sys.stderr, flush=True)
            results["runs"][variant] = run_child(variant, args, broker.bootstrap, names.stem, kdir)
        ends = asyncio.run(end_offsets(broker.bootstrap, names, args.topics))
        # 3 events from each variant, plus the commit marker of the worker's transaction.
        ends["expected_min"] = 2 * EVENTS_PER_REQUEST + 1
        results["end_offsets"] = ends
    finally:
        try:
            broker.stop()
        finally:
            shutil.rmtree(kdir, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(f"reply-topic end offsets: min {ends['min']}, max {ends['max']} (every event delivered: "
          f"{ends['min'] >= ends['expected_min']}); wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
