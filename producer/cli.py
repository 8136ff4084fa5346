"""The ``inferline`` command: submit, cancel, topics, tail, bench, gateway and batch; connection
settings from the worker's ``INFERLINE_`` environment, overridden by flags.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import re
import sys
from pathlib import Path
from typing import Any

# bench_report, loadgen and tail hold the bigger commands' parts, importable from here.
from inferline.producer.bench_report import (  # noqa: F401 - re-exported
    Sample,
    distribution,
    format_report,
    inter_token_latencies,
    percentile,
    plot,
    sample_of,
    summarize,
    throughput_series,
    write_outputs,
)
from inferline.producer.client import (
    ClientTimeout,
    InferenceClient,
    InferenceError,
    RequestCancelled,
    RequestHandle,
    RequestRejected,
    RequestTimeout,
    Result,
)
from inferline.producer.loadgen import Length, load_dataset, make_workload, run_load  # noqa: F401 - re-exported
from inferline.producer.tail import format_event, tail  # noqa: F401 - re-exported
from inferline.config.tracing import setup_tracing
from inferline.contract.topics import tenant_problem
from inferline.producer.topics import create_topics, topic_configs

# Exit codes of `submit`: scripts can tell a rejection from a timeout without parsing text.
EXIT_OK, EXIT_ERROR, EXIT_REJECTED, EXIT_TIMEOUT, EXIT_CANCELLED = 0, 1, 3, 4, 5


def exit_code(exc: BaseException | None) -> int:
    if exc is None:
        return EXIT_OK
    for cls, code in (
        (RequestRejected, EXIT_REJECTED),
        (RequestTimeout, EXIT_TIMEOUT),
        (RequestCancelled, EXIT_CANCELLED),
    ):
        if isinstance(exc, cls):
            return code
    return EXIT_ERROR


# ---------------------------------------------------------------------------------------------
# Arguments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inferline", description="Talk to inferline workers through Kafka."
    )
    parser.add_argument(
        "--bootstrap-servers", help="Kafka brokers (default: INFERLINE_KAFKA__BOOTSTRAP_SERVERS)"
    )
    parser.add_argument("--request-topic", help="default: INFERLINE_KAFKA__REQUEST_TOPIC")
    parser.add_argument("--cancel-topic", help="default: INFERLINE_KAFKA__CANCEL_TOPIC")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_submit(sub.add_parser("submit", help="send one request and stream the answer"))
    cancel = sub.add_parser("cancel", help="cancel a request by id")
    cancel.add_argument("id")
    _add_topics(sub.add_parser("topics", help="manage the request, cancel and dead-letter topics"))
    _add_tail(sub.add_parser("tail", help="decode and print the events on a reply topic"))
    _add_bench(sub.add_parser("bench", help="load generator: latency and throughput through Kafka"))
    _add_gateway(
        sub.add_parser("gateway", help="serve the OpenAI-compatible HTTP API (docs/gateway.md)")
    )
    _add_batch(
        sub.add_parser(
            "batch",
            help="run a file of requests in OpenAI's batch format, resumably (docs/batch.md)",
        )
    )
    return parser


def _add_batch(p: argparse.ArgumentParser) -> None:
    from inferline.producer.batch.local import add_arguments

    add_arguments(p)


def _add_gateway(p: argparse.ArgumentParser) -> None:
    from inferline.producer.gateway.__main__ import (
        add_arguments,
    )  # no FastAPI import until it serves

    add_arguments(p)


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--priority", type=int, default=None, help="lower runs first")
    p.add_argument("--tenant", default=None)
    p.add_argument(
        "--reply-topic",
        default=None,
        help="a topic name, or 'per-request' (default: one per client)",
    )


def _add_submit(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt, or - to read it from stdin")
    p.add_argument(
        "--chat", action="store_true", help="send as a user message (the chat template applies)"
    )
    p.add_argument("--system", help="system message (implies --chat)")
    _add_sampling(p)
    p.add_argument("--ignore-eos", action="store_true", default=None)
    p.add_argument(
        "-n", "--n", type=int, default=None, help="samples of the prompt (printed when done)"
    )
    p.add_argument(
        "--no-stream", action="store_true", help="ask for the whole text in done (no tokens events)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds: the worker's deadline; the client waits a grace period longer",
    )
    p.add_argument(
        "--client-timeout",
        type=float,
        default=None,
        help="seconds to wait for the answer (default: the worker's deadline plus a grace period)",
    )
    p.add_argument("--id", default=None, help="request id (default: random)")
    p.add_argument("--json", action="store_true", help="print raw events, one JSON object per line")
    _add_output_constraints(p)


def _add_output_constraints(p: argparse.ArgumentParser) -> None:
    shape = p.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema",
        metavar="FILE",
        help="the output is JSON valid against this JSON Schema file",
    )
    shape.add_argument("--json-object", action="store_true", help="the output is one JSON object")
    shape.add_argument("--regex", help="the output matches this regular expression")
    shape.add_argument(
        "--choice", action="append", metavar="TEXT", help="the output is one of these (repeatable)"
    )
    shape.add_argument(
        "--grammar", metavar="FILE", help="the output follows this EBNF grammar file"
    )
    p.add_argument(
        "--logprobs",
        action="store_true",
        default=None,
        help="each token's log-probability (see --json)",
    )
    p.add_argument(
        "--top-logprobs",
        type=int,
        default=None,
        metavar="K",
        help="also the K most likely tokens at each step (implies --logprobs)",
    )


def _add_topics(p: argparse.ArgumentParser) -> None:
    tsub = p.add_subparsers(dest="topics_command", required=True)
    create = tsub.add_parser(
        "create", help="create the request, cancel and dead-letter topics if missing"
    )
    create.add_argument(
        "--partitions", type=int, default=8, help="of the request topic (the workers' parallelism)"
    )
    create.add_argument(
        "--replication-factor",
        type=int,
        default=None,
        help="unset: INFERLINE_KAFKA__REPLICATION_FACTOR, else the broker's default",
    )
    create.add_argument(
        "--retention-ms", type=int, default=7 * 86_400_000, help="request topic retention"
    )
    create.add_argument(
        "--cancel-retention-ms",
        type=int,
        default=86_400_000,
        help="at least the workers' INFERLINE_KAFKA__CANCEL_LOOKBACK_S "
        "(compacted: one record per id)",
    )
    create.add_argument("--dlq-retention-ms", type=int, default=14 * 86_400_000)
    create.add_argument(
        "--reply-topic",
        action="append",
        default=[],
        metavar="NAME",
        type=reply_topic_name,
        help="also the shared reply topic <reply prefix>NAME (<reply prefix><tenant>.NAME for each "
        "--tenant), made ahead for clients and gateways that make none "
        "(INFERLINE_KAFKA__CREATE_REPLY_TOPICS=false, INFERLINE_GATEWAY__REPLY_TOPIC)",
    )
    create.add_argument("--reply-partitions", type=int, default=4)
    create.add_argument("--reply-retention-ms", type=int, default=3_600_000)
    create.add_argument("--dlq-topic", default=None, help="default: INFERLINE_KAFKA__DLQ_TOPIC")
    create.add_argument(
        "--tenant",
        action="append",
        default=[],
        metavar="NAME",
        help="topic tenancy (INFERLINE_KAFKA__TENANCY=topic): also <request topic>.NAME and "
        "<cancel topic>.NAME; repeat for more tenants (ACLs: docs/security.md)",
    )
    acls = tsub.add_parser(
        "acls", help="the ACLs of topic tenancy: print them as kafka-acls.sh commands, or --apply"
    )
    acls.add_argument(
        "--tenant", action="append", default=[], metavar="NAME", help="repeat for more tenants"
    )
    acls.add_argument(
        "--worker-principal", default="User:inferline", help="the workers' SASL principal"
    )
    acls.add_argument(
        "--apply",
        action="store_true",
        help="create them on the broker (needs confluent-kafka and an admin principal's settings)",
    )


def _add_tail(p: argparse.ArgumentParser) -> None:
    p.add_argument("topic")
    p.add_argument("--from-beginning", action="store_true")
    p.add_argument("--id", default=None, help="only this request's events")
    p.add_argument("--json", action="store_true", help="one JSON object per event")
    p.add_argument("--limit", type=int, default=None, help="stop after this many events")
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=None,
        help="stop after this many seconds without an event",
    )


def _add_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--num-requests", type=int, default=64)
    p.add_argument(
        "--rate",
        type=float,
        default=math.inf,
        help="requests/s, Poisson arrivals (default: all at once)",
    )
    p.add_argument("--prompt-len", default="fixed:32", help="tokens: fixed:N | uniform:A,B")
    p.add_argument("--output-len", default="uniform:8,256", help="tokens: fixed:N | uniform:A,B")
    p.add_argument(
        "--dataset",
        help="JSONL: prompt | prompt_token_ids | messages, and optional max_tokens per line",
    )
    p.add_argument("--vocab", default="1000,20000", help="token id range A,B for synthetic prompts")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="let requests stop at EOS (default: exact lengths)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the workload generator")
    p.add_argument(
        "--timeout", type=float, default=None, help="per request, seconds (worker deadline)"
    )
    p.add_argument(
        "--reply-topic",
        default=None,
        help="a topic name, or 'per-request' (default: one per client)",
    )
    p.add_argument(
        "--out", default="inferline-bench", help="directory for bench.json and the PNG plots"
    )
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields set on the command line."""
    names = (
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "priority",
        "tenant",
        "ignore_eos",
        "n",
    )
    params = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    if getattr(args, "no_stream", False):
        params["stream"] = False
    if getattr(args, "timeout", None) is not None:
        params["timeout_s"] = args.timeout
    return params | output_constraint(args)


def output_constraint(args: argparse.Namespace) -> dict[str, Any]:
    """response_format / structured / logprobs fields from the flags (files are read here)."""
    fields: dict[str, Any] = {}
    if getattr(args, "json_schema", None):
        path = Path(args.json_schema)
        schema = json.loads(path.read_text())
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": path.stem, "schema": schema, "strict": True},
        }
    elif getattr(args, "json_object", False):
        fields["response_format"] = {"type": "json_object"}
    elif getattr(args, "regex", None) is not None:
        fields["structured"] = {"regex": args.regex}
    elif getattr(args, "choice", None):
        fields["structured"] = {"choice": args.choice}
    elif getattr(args, "grammar", None):
        fields["structured"] = {"grammar": Path(args.grammar).read_text()}
    if getattr(args, "top_logprobs", None) is not None:
        fields |= {"logprobs": True, "top_logprobs": args.top_logprobs}
    elif getattr(args, "logprobs", None):
        fields["logprobs"] = True
    return fields


def prompt_fields(args: argparse.Namespace, stdin=None) -> dict[str, Any]:
    """prompt or messages from the positional argument (``-``: stdin), --chat and --system."""
    text = (stdin or sys.stdin).read() if args.prompt == "-" else args.prompt
    if not (args.chat or args.system):
        return {"prompt": text}
    messages = [{"role": "system", "content": args.system}] if args.system else []
    return {"messages": messages + [{"role": "user", "content": text}]}


def make_client(args: argparse.Namespace, **kw: Any) -> InferenceClient:
    return InferenceClient(
        args.bootstrap_servers,
        request_topic=args.request_topic,
        cancel_topic=args.cancel_topic,
        **kw,
    )


# ---------------------------------------------------------------------------------------------
# submit, cancel, topics, tail, bench


async def cmd_submit(args: argparse.Namespace) -> int:
    fields = {**prompt_fields(args), **sampling_params(args)}
    async with make_client(args, reply_topic=args.reply_topic) as client:
        handle = await client.submit(request_id=args.id, timeout=args.client_timeout, **fields)
        print(f"[request {handle.id}]", file=sys.stderr, flush=True)
        try:
            await (
                _print_events(handle)
                if args.json
                else _print_samples(handle)
                if (args.n or 1) > 1
                else _print_text(handle)
            )
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
                print(
                    f"\n[worker lost: restarting as attempt {delta.attempt}]",
                    file=sys.stderr,
                    flush=True,
                )
            print(delta, end="", flush=True)
    print()


async def _print_samples(handle: RequestHandle) -> None:
    result = await handle.result(check=False)
    for sample in result.samples or []:
        print(
            f"[sample {sample.index} · {sample.finish_reason} · {sample.completion_tokens} tokens]",
            file=sys.stderr,
        )
        print(sample.text, flush=True)


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

    from inferline.contract.schema import Cancel, encode_cancel

    client = make_client(args)  # for its settings only
    producer = AIOKafkaProducer(**client.kafka.connection_options(), enable_idempotence=True)
    await producer.start()
    try:
        await producer.send_and_wait(
            client.cancel_topic, encode_cancel(Cancel(id=args.id)), key=args.id.encode()
        )
    finally:
        await producer.stop()
    print(f"cancel sent for {args.id} to {client.cancel_topic}", file=sys.stderr)
    return EXIT_OK


def reply_topic_name(name: str) -> str:
    """A --reply-topic: what follows the reply prefix (and the tenant) in a topic name."""
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", name):
        raise argparse.ArgumentTypeError(f"{name!r}: 1-64 of a-z, A-Z, 0-9, '.', '_', '-'")
    return name


def checked_tenants(args: argparse.Namespace, kafka) -> list[str]:
    """--tenant names: each one topic-name segment, none naming or colliding with an internal
    topic (`dlq` would grant `<request topic>.dlq`)."""
    for tenant in args.tenant:
        problem = tenant_problem(tenant, kafka, getattr(args, "dlq_topic", None))
        if problem:
            raise SystemExit(f"inferline topics {args.topics_command}: tenant {tenant!r} {problem}")
    return args.tenant


async def cmd_topics(args: argparse.Namespace) -> int:
    if args.topics_command == "acls":
        return await cmd_acls(args)
    from aiokafka.admin import AIOKafkaAdminClient

    client = make_client(args)
    tenants = checked_tenants(
        args,
        client.kafka.model_copy(
            update={"request_topic": client.request_topic, "cancel_topic": client.cancel_topic}
        ),
    )
    admin = AIOKafkaAdminClient(**client.kafka.connection_options())
    await admin.start()
    try:
        plan = [
            (client.request_topic, args.partitions, args.retention_ms),
            # Every worker reads every cancel partition, so one is plenty.
            (client.cancel_topic, 1, args.cancel_retention_ms),
            (args.dlq_topic or client.kafka.dlq_topic, 1, args.dlq_retention_ms),
        ]
        cancel_topics = {client.cancel_topic} | {f"{client.cancel_topic}.{t}" for t in args.tenant}
        for tenant in tenants:
            plan += [
                (f"{client.request_topic}.{tenant}", args.partitions, args.retention_ms),
                (f"{client.cancel_topic}.{tenant}", 1, args.cancel_retention_ms),
            ]
        prefix = client.kafka.reply_topic_prefix
        plan += [
            (f"{prefix}{tenant}{name}", args.reply_partitions, args.reply_retention_ms)
            for name in args.reply_topic
            for tenant in ([f"{t}." for t in tenants] or [""])
        ]
        for name, partitions, retention in plan:
            configs = topic_configs(retention)
            if name in cancel_topics:  # compaction keeps one cancel per request id
                configs["cleanup.policy"] = "compact,delete"
            created = await create_topics(
                admin,
                [(name, partitions)],
                replication_factor=args.replication_factor or client.kafka.replication_factor,
                min_insync_replicas=client.kafka.min_insync_replicas,
                configs=configs,
            )
            print(
                f"{name}: {'created' if created else 'exists'} "
                f"({partitions} partitions, retention {retention} ms)"
            )
    finally:
        await admin.close()
    return EXIT_OK


async def cmd_acls(args: argparse.Namespace) -> int:
    from inferline.producer.acls import apply, recipe

    kafka = make_client(args).kafka
    rules = recipe(kafka, args.worker_principal, checked_tenants(args, kafka))
    if args.apply:
        await apply(kafka, rules)
    for rule in rules:
        print(("created: " if args.apply else "") + rule.command(kafka.bootstrap_servers))
    return EXIT_OK


async def cmd_tail(args: argparse.Namespace) -> int:
    await tail(make_client(args).kafka, args)
    return EXIT_OK


async def cmd_bench(args: argparse.Namespace) -> int:
    workload = make_workload(args)
    async with make_client(args, reply_topic=args.reply_topic) as client:
        samples, wall_s, t0 = await run_load(
            client, workload, args.rate, random.Random(args.seed + 1), not args.no_progress
        )
    report = summarize(samples, wall_s)
    report["config"] = {
        k: v
        for k, v in vars(args).items()
        if k != "func" and isinstance(v, (int, float, str, bool, type(None)))
    }
    print(format_report(report))
    write_outputs(Path(args.out), report, samples, t0, plots=not args.no_plots)
    return EXIT_OK if report["completed"] == report["requests"] else EXIT_ERROR


# ---------------------------------------------------------------------------------------------


async def cmd_gateway(args: argparse.Namespace) -> int:
    from inferline.producer.gateway.__main__ import serve

    return await serve(args)


async def cmd_batch(args: argparse.Namespace) -> int:
    from inferline.producer.batch.local import cmd_batch as run_batch

    return await run_batch(args, make_client)


COMMANDS = {
    "submit": cmd_submit,
    "cancel": cmd_cancel,
    "topics": cmd_topics,
    "tail": cmd_tail,
    "bench": cmd_bench,
    "gateway": cmd_gateway,
    "batch": cmd_batch,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``inferline`` and ``python -m inferline.producer``."""
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        # Fail on a bad distribution before connecting to anything.
        for spec in (args.prompt_len, args.output_len):
            try:
                Length.parse(spec)
            except argparse.ArgumentTypeError as exc:
                build_parser().error(str(exc))
    if args.command != "gateway":  # the gateway sets up its own, under its own name
        setup_tracing("inferline-client")  # OTEL_TRACES_EXPORTER: off unless it names one
    try:
        return asyncio.run(COMMANDS[args.command](args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
