"""``inferline tail``: print the events on a reply topic, one human line (or JSON object) each."""

from __future__ import annotations

import argparse
import sys
import time

from aiokafka import AIOKafkaConsumer, TopicPartition

from inferline.config.settings import KafkaSettings
from inferline.contract.schema import UndecodableMessage, decode_event


async def tail(kafka: KafkaSettings, args: argparse.Namespace) -> None:
    """Print ``args.topic``'s events until ``args.limit`` or ``args.idle_timeout``, or forever."""
    consumer = AIOKafkaConsumer(
        **kafka.connection_options(),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest" if args.from_beginning else "latest",
        isolation_level="read_committed",  # no `done` of an aborted transaction
    )
    await consumer.start()
    try:
        parts = await _partitions(consumer, args.topic)
        consumer.assign([TopicPartition(args.topic, p) for p in parts])
        await _tail_loop(consumer, args)
    finally:
        await consumer.stop()


async def _partitions(consumer, topic: str) -> set[int]:
    # All topics' metadata: asking for one by name would auto-create it on most brokers.
    cluster = await consumer._client.fetch_all_metadata()
    parts = cluster.partitions_for_topic(topic)
    if not parts:
        raise SystemExit(f"inferline tail: no topic {topic!r}")
    return parts


async def _tail_loop(consumer, args: argparse.Namespace) -> None:
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
    head = f"{ev.id} {ev.attempt}#{ev.seq} {ev.type}"
    if ev.type == "started":
        return f"{head} worker={ev.worker} queue={ev.queue_s:.3f}s"
    if ev.type == "tokens":
        sample = f" [{ev.index}]" if ev.index else ""
        return f"{head}{sample} {len(ev.token_ids)} tok {ev.text!r}"
    err = f" error={ev.error.code}: {ev.error.message}" if ev.error else ""
    return (
        f"{head} {ev.finish_reason} {ev.usage.prompt_tokens}+{ev.usage.completion_tokens} tok "
        f"total={ev.timing.total_s:.3f}s{err}"
    )
