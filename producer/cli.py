"""The ``inferline`` command: submit, cancel, topics create, tail, bench.

    inferline submit "Explain Kafka in one sentence"     stream the answer
    echo "Hi" | inferline submit - --chat --json          raw events, one JSON object a line
    inferline cancel ID
    inferline topics create --partitions 8 --retention-ms 86400000
    inferline tail TOPIC                                  decode and print reply events
    inferline bench -n 64 --output-len uniform:8,256      load test through Kafka

Connection settings come from the same ``INFERLINE_`` environment as the worker
(INFERLINE_KAFKA__BOOTSTRAP_SERVERS, ...); ``--bootstrap-servers`` etc. override them.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from producer.client import (
    PER_REQUEST,
    ClientTimeout,
    InferenceClient,
    InferenceError,
    RequestCancelled,
    RequestHandle,
    RequestRejected,
    RequestTimeout,
    Result,
    create_topics,
    kafka_options,
    topic_configs,
)
from producer.schema import UndecodableMessage, decode_event

# Exit codes of `submit`: scripts can tell a rejection from a timeout without parsing text.
EXIT_OK, EXIT_ERROR, EXIT_REJECTED, EXIT_TIMEOUT, EXIT_CANCELLED = 0, 1, 3, 4, 5


def exit_code(exc: BaseException | None) -> int:
    if exc is None:
        return EXIT_OK
    for cls, code in ((RequestRejected, EXIT_REJECTED), (RequestTimeout, EXIT_TIMEOUT), (RequestCancelled, EXIT_CANCELLED)):
        if isinstance(exc, cls):
            return code
    return EXIT_ERROR


# ---------------------------------------------------------------------------------------------
# Arguments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferline", description="Talk to inferline workers through Kafka.")
    parser.add_argument("--bootstrap-servers", help="Kafka brokers (default: INFERLINE_KAFKA__BOOTSTRAP_SERVERS)")
    parser.add_argument("--request-topic", help="default: INFERLINE_KAFKA__REQUEST_TOPIC")
    parser.add_argument("--cancel-topic", help="default: INFERLINE_KAFKA__CANCEL_TOPIC")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_submit(sub.add_parser("submit", help="send one request and stream the answer"))
    cancel = sub.add_parser("cancel", help="cancel a request by id")
    cancel.add_argument("id")
    _add_topics(sub.add_parser("topics", help="manage the request, cancel and dead-letter topics"))
    _add_tail(sub.add_parser("tail", help="decode and print the events on a reply topic"))
    _add_bench(sub.add_parser("bench", help="load generator: latency and throughput through Kafka"))
    return parser


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--priority", type=int, default=None, help="lower runs first")
    p.add_argument("--tenant", default=None)
    p.add_argument("--reply-topic", default=None, help="a topic name, or 'per-request' (default: one per client)")


def _add_submit(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt, or - to read it from stdin")
    p.add_argument("--chat", action="store_true", help="send as a user message (the chat template applies)")
    p.add_argument("--system", help="system message (implies --chat)")
    _add_sampling(p)
    p.add_argument("--ignore-eos", action="store_true", default=None)
    p.add_argument("--no-stream", action="store_true", help="ask for the whole text in done (no tokens events)")
    p.add_argument("--timeout", type=float, default=None, help="seconds: the worker's deadline; the client waits a grace period longer")
    p.add_argument("--client-timeout", type=float, default=None,
                   help="seconds to wait for the answer (default: the worker's deadline plus a grace period)")
    p.add_argument("--id", default=None, help="request id (default: random)")
    p.add_argument("--json", action="store_true", help="print raw events, one JSON object per line")


def _add_topics(p: argparse.ArgumentParser) -> None:
    tsub = p.add_subparsers(dest="topics_command", required=True)
    create = tsub.add_parser("create", help="create the request, cancel and dead-letter topics if missing")
    create.add_argument("--partitions", type=int, default=8, help="of the request topic (the workers' parallelism)")
    create.add_argument("--replication-factor", type=int, default=1)
    create.add_argument("--retention-ms", type=int, default=7 * 86_400_000, help="request topic retention")
    create.add_argument("--cancel-retention-ms", type=int, default=3_600_000)
    create.add_argument("--dlq-retention-ms", type=int, default=14 * 86_400_000)
    create.add_argument("--dlq-topic", default=None, help="default: INFERLINE_KAFKA__DLQ_TOPIC")


def _add_tail(p: argparse.ArgumentParser) -> None:
    p.add_argument("topic")
    p.add_argument("--from-beginning", action="store_true")
    p.add_argument("--id", default=None, help="only this request's events")
    p.add_argument("--json", action="store_true", help="one JSON object per event")
    p.add_argument("--limit", type=int, default=None, help="stop after this many events")
    p.add_argument("--idle-timeout", type=float, default=None, help="stop after this many seconds without an event")


def _add_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--num-requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=math.inf, help="requests/s, Poisson arrivals (default: all at once)")
    p.add_argument("--prompt-len", default="fixed:32", help="tokens: fixed:N | uniform:A,B")
    p.add_argument("--output-len", default="uniform:8,256", help="tokens: fixed:N | uniform:A,B")
    p.add_argument("--dataset", help="JSONL: prompt | prompt_token_ids | messages, and optional max_tokens per line")
    p.add_argument("--vocab", default="1000,20000", help="token id range A,B for synthetic prompts")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (default: exact lengths)")
    p.add_argument("--seed", type=int, default=0, help="seeds the workload generator")
    p.add_argument("--timeout", type=float, default=None, help="per request, seconds (worker deadline)")
    p.add_argument("--reply-topic", default=None, help="a topic name, or 'per-request' (default: one per client)")
    p.add_argument("--out", default="inferline-bench", help="directory for bench.json and the PNG plots")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields set on the command line (unset ones keep the contract's defaults)."""
    names = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "priority", "tenant", "ignore_eos")
    params = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    if getattr(args, "no_stream", False):
        params["stream"] = False
    if getattr(args, "timeout", None) is not None:
        params["timeout_s"] = args.timeout
    return params


def prompt_fields(args: argparse.Namespace, stdin=None) -> dict[str, Any]:
    """prompt or messages from the positional argument (``-``: stdin), --chat and --system."""
    text = (stdin or sys.stdin).read() if args.prompt == "-" else args.prompt
    if not (args.chat or args.system):
        return {"prompt": text}
    messages = [{"role": "system", "content": args.system}] if args.system else []
    return {"messages": messages + [{"role": "user", "content": text}]}


def make_client(args: argparse.Namespace, **kw: Any) -> InferenceClient:
    return InferenceClient(
        args.bootstrap_servers, request_topic=args.request_topic, cancel_topic=args.cancel_topic, **kw
    )


# ---------------------------------------------------------------------------------------------
# submit, cancel, topics, tail


async def cmd_submit(args: argparse.Namespace) -> int:
    fields = {**prompt_fields(args), **sampling_params(args)}
    async with make_client(args, reply_topic=args.reply_topic) as client:
        handle = await client.submit(request_id=args.id, timeout=args.client_timeout, **fields)
        print(f"[request {handle.id}]", file=sys.stderr, flush=True)
        try:
            await (_print_events(handle) if args.json else _print_text(handle))
        except (KeyboardInterrupt, asyncio.CancelledError):
            await client.cancel(handle.id)
            raise
        result = await handle.result(check=False)
    failure = handle.failure
    if not args.json:
        print(_summary_line(result, failure), file=sys.stderr)
    return exit_code(failure)


async def _print_text(handle: RequestHandle) -> None:
    with contextlib.suppress(InferenceError):  # reported by the summary line
        async for delta in handle.text():
            if delta.restart:
                print(f"\n[worker lost: restarting as attempt {delta.attempt}]", file=sys.stderr, flush=True)
            print(delta, end="", flush=True)
    print()


async def _print_events(handle: RequestHandle) -> None:
    with contextlib.suppress(ClientTimeout):
        async for ev in handle.events():
            print(ev.model_dump_json(), flush=True)


def _summary_line(result: Result, failure: InferenceError | None) -> str:
    parts = [result.finish_reason]
    if failure is not None:
        parts.append(str(failure))
    if result.usage:
        parts.append(f"{result.usage.prompt_tokens}+{result.usage.completion_tokens} tokens")
    if result.client_ttft_s is not None:
        parts.append(f"ttft {result.client_ttft_s:.3f}s")
    if result.client_total_s is not None:
        parts.append(f"total {result.client_total_s:.3f}s")
    if result.attempts > 1:
        parts.append(f"{result.attempts} attempts")
    return "[" + " · ".join(parts) + "]"


async def cmd_cancel(args: argparse.Namespace) -> int:
    from aiokafka import AIOKafkaProducer

    from producer.schema import Cancel, encode_cancel

    client = make_client(args)  # for its settings only: no reply topic is needed to cancel
    producer = AIOKafkaProducer(**kafka_options(client.kafka), enable_idempotence=True)
    await producer.start()
    try:
        await producer.send_and_wait(client.cancel_topic, encode_cancel(Cancel(id=args.id)), key=args.id.encode())
    finally:
        await producer.stop()
    print(f"cancel sent for {args.id} to {client.cancel_topic}", file=sys.stderr)
    return EXIT_OK


async def cmd_topics(args: argparse.Namespace) -> int:
    from aiokafka.admin import AIOKafkaAdminClient

    client = make_client(args)
    admin = AIOKafkaAdminClient(**kafka_options(client.kafka))
    await admin.start()
    try:
        plan = [
            (client.request_topic, args.partitions, args.retention_ms),
            # Every worker reads every cancel partition, so one is plenty.
            (client.cancel_topic, 1, args.cancel_retention_ms),
            (args.dlq_topic or client.kafka.dlq_topic, 1, args.dlq_retention_ms),
        ]
        for name, partitions, retention in plan:
            created = await create_topics(
                admin, [(name, partitions)], replication_factor=args.replication_factor, configs=topic_configs(retention)
            )
            print(f"{name}: {'created' if created else 'exists'} ({partitions} partitions, retention {retention} ms)")
    finally:
        await admin.close()
    return EXIT_OK


async def cmd_tail(args: argparse.Namespace) -> int:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    client = make_client(args)
    consumer = AIOKafkaConsumer(
        **kafka_options(client.kafka), group_id=None, enable_auto_commit=False,
        auto_offset_reset="earliest" if args.from_beginning else "latest",
    )
    await consumer.start()
    try:
        parts = await _partitions(consumer, args.topic)
        consumer.assign([TopicPartition(args.topic, p) for p in parts])
        return await _tail_loop(consumer, args)
    finally:
        await consumer.stop()


async def _partitions(consumer, topic: str) -> set[int]:
    # All topics' metadata: asking for this one by name would auto-create it on most brokers,
    # and partitions_for_topic() only knows subscribed topics.
    cluster = await consumer._client.fetch_all_metadata()
    parts = cluster.partitions_for_topic(topic)
    if not parts:
        raise SystemExit(f"inferline tail: no topic {topic!r}")
    return parts


async def _tail_loop(consumer, args: argparse.Namespace) -> int:
    count, last = 0, time.monotonic()
    while args.limit is None or count < args.limit:
        if args.idle_timeout is not None and time.monotonic() - last > args.idle_timeout:
            break
        batches = await consumer.getmany(timeout_ms=200)
        for record in (r for rs in batches.values() for r in rs):
            if args.limit is not None and count >= args.limit:
                break
            last = time.monotonic()
            count += _print_record(record, args)
    return EXIT_OK


def _print_record(record, args: argparse.Namespace) -> int:
    try:
        ev = decode_event(record.value)
    except UndecodableMessage as exc:
        print(f"p{record.partition}@{record.offset} undecodable: {exc.reason}", file=sys.stderr)
        return 0
    if args.id and ev.id != args.id:
        return 0
    print(ev.model_dump_json() if args.json else format_event(ev), flush=True)
    return 1


def format_event(ev) -> str:
    """One human line per event."""
    head = f"{ev.id} {ev.attempt}#{ev.seq} {ev.type}"
    if ev.type == "started":
        return f"{head} worker={ev.worker} queue={ev.queue_s:.3f}s"
    if ev.type == "tokens":
        return f"{head} {len(ev.token_ids)} tok {ev.text!r}"
    err = f" error={ev.error.code}: {ev.error.message}" if ev.error else ""
    return (f"{head} {ev.finish_reason} {ev.usage.prompt_tokens}+{ev.usage.completion_tokens} tok "
            f"total={ev.timing.total_s:.3f}s{err}")


# ---------------------------------------------------------------------------------------------
# bench: workload


@dataclass
class Length:
    """A token-length distribution: ``fixed:N`` or ``uniform:A,B`` (both ends included)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> Length:
        kind, _, spec = text.partition(":")
        try:
            if kind == "fixed":
                n = int(spec)
                return cls._checked(n, n)
            if kind == "uniform":
                a, b = (int(x) for x in spec.split(","))
                return cls._checked(a, b)
        except ValueError:
            pass
        raise argparse.ArgumentTypeError(f"bad length {text!r}: use fixed:N or uniform:A,B with 1 <= A <= B")

    @classmethod
    def _checked(cls, a: int, b: int) -> Length:
        if not 1 <= a <= b:
            raise ValueError
        return cls(a, b)

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


def make_workload(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The request fields of each bench request, reproducible from --seed."""
    rng = random.Random(args.seed)
    common = {"temperature": args.temperature, "ignore_eos": not args.no_ignore_eos}
    if args.timeout is not None:
        common["timeout_s"] = args.timeout
    if args.dataset:
        rows = load_dataset(args.dataset)
        return [{**common, **rows[i % len(rows)]} for i in range(args.num_requests)]
    prompt_len, output_len = Length.parse(args.prompt_len), Length.parse(args.output_len)
    lo, hi = (int(x) for x in args.vocab.split(","))
    return [
        {**common, "prompt_token_ids": [rng.randrange(lo, hi) for _ in range(prompt_len.sample(rng))],
         "max_tokens": output_len.sample(rng)}
        for _ in range(args.num_requests)
    ]


def load_dataset(path: str) -> list[dict[str, Any]]:
    """JSONL rows: one of prompt / prompt_token_ids / messages, optional max_tokens
    (or output_len); other keys are ignored."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        obj = json.loads(line)
        row = {k: obj[k] for k in ("prompt", "prompt_token_ids", "messages", "max_tokens") if k in obj}
        if "output_len" in obj:
            row["max_tokens"] = obj["output_len"]
        rows.append(row)
    if not rows:
        raise SystemExit(f"inferline bench: {path} has no rows")
    return rows


# ---------------------------------------------------------------------------------------------
# bench: statistics


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, float | None]:
    return {
        "mean": sum(values) / len(values) if values else None,
        "p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
        "max": max(values) if values else None, "n": len(values),
    }


def inter_token_latencies(token_times: list[tuple[float, int]]) -> list[float]:
    """Per-token gaps: an event carrying n tokens after a gap g adds n samples of g/n."""
    out = []
    for (t0, _), (t1, n) in zip(token_times, token_times[1:]):
        if n > 0:
            out.extend([(t1 - t0) / n] * n)
    return out


@dataclass
class Sample:
    """What bench keeps of one request."""

    ok: bool
    code: str | None
    ttft_s: float | None
    e2e_s: float | None
    queue_s: float | None
    output_tokens: int
    itl: list[float]
    token_times: list[tuple[float, int]]  # absolute monotonic times, for throughput over time
    attempts: int


def sample_of(handle: RequestHandle) -> Sample:
    r = handle.partial_result()
    failure = handle.failure
    return Sample(
        ok=failure is None, code=None if failure is None else failure.code,
        ttft_s=r.client_ttft_s, e2e_s=r.client_total_s, queue_s=r.timing.queue_s if r.timing else None,
        output_tokens=r.usage.completion_tokens if r.usage else len(r.token_ids),
        itl=inter_token_latencies(handle.token_times), token_times=list(handle.token_times), attempts=r.attempts,
    )


def summarize(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    """The bench report: throughput, latency distributions and errors by code."""
    ok = [s for s in samples if s.ok]
    errors: dict[str, int] = {}
    for s in samples:
        if not s.ok:
            errors[s.code or "unknown"] = errors.get(s.code or "unknown", 0) + 1
    tokens = sum(s.output_tokens for s in ok)
    return {
        "requests": len(samples), "completed": len(ok), "errors": errors, "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "output_tokens": tokens, "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "ttft_s": distribution([s.ttft_s for s in ok if s.ttft_s is not None]),
        "itl_s": distribution([x for s in ok for x in s.itl]),
        "e2e_s": distribution([s.e2e_s for s in ok if s.e2e_s is not None]),
        "queue_s": distribution([s.queue_s for s in ok if s.queue_s is not None]),
        "restarted_requests": sum(1 for s in samples if s.attempts > 1),
    }


def throughput_series(samples: list[Sample], t0: float, bucket_s: float = 1.0) -> list[tuple[float, float]]:
    """(time since start, output tokens/s) per bucket."""
    counts: dict[int, int] = {}
    for s in samples:
        for t, n in s.token_times:
            b = int((t - t0) // bucket_s)
            counts[b] = counts.get(b, 0) + n
    if not counts:
        return []
    return [(b * bucket_s, counts.get(b, 0) / bucket_s) for b in range(max(counts) + 1)]


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"requests     {report['completed']}/{report['requests']} ok in {report['wall_s']:.2f} s"
        f"  ({_fmt(report['requests_per_s'])} req/s, {_fmt(report['output_tokens_per_s'])} output tok/s)",
        f"errors       {report['errors'] or 'none'}",
    ]
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("e2e_s", "e2e"), ("queue_s", "queue")):
        d = report[key]
        lines.append(f"{label:<12} p50 {_ms(d['p50'])}  p90 {_ms(d['p90'])}  p99 {_ms(d['p99'])}  mean {_ms(d['mean'])}")
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _ms(x: float | None) -> str:
    return "      -" if x is None else f"{x * 1000:7.1f} ms"


# ---------------------------------------------------------------------------------------------
# bench: run


async def cmd_bench(args: argparse.Namespace) -> int:
    workload = make_workload(args)
    async with make_client(args, reply_topic=args.reply_topic) as client:
        samples, wall_s, t0 = await run_load(client, workload, args.rate, random.Random(args.seed + 1), not args.no_progress)
    report = summarize(samples, wall_s)
    report["config"] = {k: v for k, v in vars(args).items() if k != "func" and isinstance(v, (int, float, str, bool, type(None)))}
    print(format_report(report))
    write_outputs(Path(args.out), report, samples, t0, plots=not args.no_plots)
    return EXIT_OK if report["completed"] == report["requests"] else EXIT_ERROR


async def run_load(
    client: InferenceClient, workload: list[dict[str, Any]], rate: float, rng: random.Random, progress: bool
) -> tuple[list[Sample], float, float]:
    """Submit the workload (Poisson arrivals at ``rate``, or all at once) and wait for every
    result. One task per request (never per event)."""
    from tqdm import tqdm

    bar = tqdm(total=len(workload), unit="req", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    tokens = 0
    t0 = time.monotonic()

    async def one(fields: dict[str, Any]) -> Sample:
        nonlocal tokens
        handle = await client.submit(**fields)
        await handle.result(check=False)
        sample = sample_of(handle)
        tokens += sample.output_tokens
        bar.update(1)
        bar.set_postfix_str(f"{tokens / (time.monotonic() - t0):.1f} tok/s")
        return sample

    tasks = []
    for fields in workload:
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
        tasks.append(asyncio.create_task(one(fields)))
    samples = await asyncio.gather(*tasks)
    bar.close()
    return list(samples), time.monotonic() - t0, t0


def write_outputs(out: Path, report: dict[str, Any], samples: list[Sample], t0: float, plots: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report = {**report, "throughput_over_time": throughput_series(samples, t0)}
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    written = [out / "bench.json"]
    if plots:
        written += plot(out, samples, report["throughput_over_time"])
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)


def plot(out: Path, samples: list[Sample], series: list[tuple[float, float]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    ok = [s for s in samples if s.ok]
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in (("TTFT", [s.ttft_s for s in ok if s.ttft_s is not None]),
                          ("ITL", [x for s in ok for x in s.itl]),
                          ("end-to-end", [s.e2e_s for s in ok if s.e2e_s is not None])):
        if values:
            xs = sorted(values)
            ax.plot([x * 1000 for x in xs], [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    ax.set(xscale="log", xlabel="latency (ms)", ylabel="fraction of samples", title="latency CDF")
    ax.legend()
    ax.grid(alpha=0.3)
    cdf = out / "latency_cdf.png"
    fig.savefig(cdf, dpi=100, bbox_inches="tight")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([t for t, _ in series], [v for _, v in series], drawstyle="steps-post")
    ax.set(xlabel="time since start (s)", ylabel="output tokens/s", title="throughput over time")
    ax.grid(alpha=0.3)
    tput = out / "throughput.png"
    fig.savefig(tput, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return [cdf, tput]


# ---------------------------------------------------------------------------------------------


COMMANDS = {"submit": cmd_submit, "cancel": cmd_cancel, "topics": cmd_topics, "tail": cmd_tail, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``inferline`` console script and ``python -m producer``."""
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        # Fail on a bad distribution before connecting to anything.
        for spec in (args.prompt_len, args.output_len):
            try:
                Length.parse(spec)
            except argparse.ArgumentTypeError as exc:
                build_parser().error(str(exc))
    try:
        return asyncio.run(COMMANDS[args.command](args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
