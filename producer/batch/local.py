"""`inferline batch run IN -o OUT`: a batch input file through the fleet into an output file,
resumed by running the command again (docs/batch.md#resume-and-exactly-once).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka.admin import AIOKafkaAdminClient

from inferline.producer.batch.lines import (
    BATCH_PRIORITY,
    BatchLine,
    DuplicateCustomIds,
    failed,
    line_key,
    parse_lines,
)
from inferline.producer.batch.runner import BatchRunner, Progress
from inferline.config.settings import load_settings
from inferline.contract.schema import json_object
from inferline.producer.client import InferenceClient

STATE_SUFFIX = ".state"
REPLY_RETENTION_MS = 7 * 86_400_000  # answers of an interrupted run wait this long
EXIT_OK, EXIT_FAILED_LINES, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="batch_command", required=True)
    run = sub.add_parser(
        "run", help="run a batch input file (OpenAI's batch format); run again to resume"
    )
    run.add_argument(
        "input",
        help="JSONL: custom_id, method, url (/v1/chat/completions or /v1/completions), body",
    )
    run.add_argument(
        "-o", "--output", required=True, help="JSONL results in OpenAI's batch output format"
    )
    run.add_argument(
        "--max-in-flight", type=int, default=64, help="requests sent and not yet answered, at most"
    )
    run.add_argument(
        "--priority",
        type=int,
        default=BATCH_PRIORITY,
        help=f"the batch's priority class (lower runs first; interactive requests: 0; "
        f"default {BATCH_PRIORITY}); a line may ask for a later one, not an earlier one",
    )
    run.add_argument(
        "--timeout", type=float, default=None, help="seconds: each request's deadline at the worker"
    )
    run.add_argument(
        "--model",
        default=None,
        help="the `model` of answers whose line names none "
        "(default: INFERLINE_GATEWAY__MODEL_NAME)",
    )
    run.add_argument(
        "--keep", action="store_true", help="keep the state file and the reply topic when done"
    )
    run.add_argument("--no-progress", action="store_true")


@dataclass
class State:
    """``OUT.state``: a header line, then one line per request id sent."""

    path: Path
    batch_id: str
    input_sha256: str
    sent: set[str] = field(default_factory=set)

    @classmethod
    def load_or_create(cls, path: Path, input_sha256: str) -> tuple[State, bool]:
        """The state of an earlier run (resumed: True), or a new batch."""
        if path.exists():
            lines = path.read_text(encoding="utf-8").splitlines()
            head = json_object(lines[0]) if lines else None
            if head and isinstance(head.get("batch_id"), str):
                sent = {
                    d["sent"]
                    for d in map(json_object, lines[1:])
                    if d and isinstance(d.get("sent"), str)
                }
                return cls(path, head["batch_id"], head.get("input_sha256", ""), sent), True
        state = cls(path, f"batch_{uuid.uuid4().hex[:16]}", input_sha256)
        header = {
            "inferline_batch": 1,
            "batch_id": state.batch_id,
            "input_sha256": input_sha256,
            "created_at": time.time(),
        }
        path.write_text(json.dumps(header) + "\n", encoding="utf-8")
        return state, False

    def open(self):
        self._file = self.path.open("a", encoding="utf-8")
        return self._file

    def record_sent(self, rid: str) -> None:
        self._file.write(json.dumps({"sent": rid}) + "\n")
        self._file.flush()


def read_output(path: Path) -> dict[str, dict]:
    """The output lines already written, by key; a last line cut short by a kill is dropped."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with path.open("r+b") as f:
            f.truncate(len(whole))
    out = {}
    for raw in whole.decode("utf-8", "replace").splitlines():
        obj = json_object(raw)
        key = line_key(obj) if obj else None
        if key is not None:
            out[key] = obj
    return out


class BatchProgress:
    """The progress bar: lines done, failed, completion tokens/s of this run, ETA."""

    def __init__(self, total: int, initial: int, enabled: bool):
        from tqdm import tqdm

        self.t0 = time.monotonic()
        self.bar = tqdm(
            total=total,
            initial=initial,
            unit="line",
            desc="batch",
            file=sys.stderr,
            disable=not enabled,
            dynamic_ncols=True,
            smoothing=0.1,
        )

    def update(self, progress: Progress) -> None:
        rate = progress.completion_tokens / max(time.monotonic() - self.t0, 1e-6)
        self.bar.set_postfix_str(f"failed={progress.failed} tok/s={rate:.0f}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


async def cmd_batch(args: argparse.Namespace, make_client) -> int:
    """`inferline batch run`; ``make_client(args, **kw)`` builds the InferenceClient."""
    src, dst = Path(args.input), Path(args.output)
    try:
        text = src.read_text(encoding="utf-8")
        lines = parse_lines(text, priority=args.priority)
    except (OSError, UnicodeDecodeError, DuplicateCustomIds) as exc:
        print(f"inferline batch: {src}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    written = read_output(dst)
    state, resumed = State.load_or_create(dst.with_name(dst.name + STATE_SUFFIX), _sha256(text))
    if resumed and state.input_sha256 != _sha256(text):
        print(
            f"inferline batch: {src} changed since this batch started; lines are matched by "
            "custom_id and content, so changed lines are sent as new requests",
            file=sys.stderr,
        )
    todo = [ln for ln in lines if ln.key not in written]
    settings = load_settings()
    topic = f"{settings.kafka.reply_topic_prefix}batch-{state.batch_id}"
    client = make_client(
        args, reply_topic=topic, reply_retention_ms=REPLY_RETENTION_MS, settings=settings
    )
    print(
        f"inferline batch: {state.batch_id}: {len(lines)} lines, "
        f"{len(lines) - len(todo)} answered before, {len(todo)} to do",
        file=sys.stderr,
    )
    t0 = time.monotonic()
    progress = await _run(args, client, state, lines, todo, dst)
    outputs = read_output(dst)
    bad = sum(failed(o) for o in outputs.values())
    print(
        f"inferline batch: {state.batch_id}: {len(outputs)} lines in {dst}, {bad} failed; "
        f"this run: {progress.done} lines ({progress.found} answered by an earlier run, "
        f"{progress.followed} sent by one and awaited), {progress.retries} retries, "
        f"{progress.completion_tokens} completion tokens in {time.monotonic() - t0:.1f} s",
        file=sys.stderr,
    )
    if not args.keep:  # every line answered: nothing left to resume
        state.path.unlink(missing_ok=True)
        await drop_topic(client, topic)
    return EXIT_FAILED_LINES if bad else EXIT_OK


async def _run(
    args,
    client: InferenceClient,
    state: State,
    lines: list[BatchLine],
    todo: list[BatchLine],
    dst: Path,
) -> Progress:
    bar = BatchProgress(len(lines), len(lines) - len(todo), not args.no_progress)
    with dst.open("a", encoding="utf-8") as out, state.open():

        def sink(_line: BatchLine, obj: dict, _tokens: int) -> None:
            out.write(json.dumps(obj, ensure_ascii=False) + "\n")
            out.flush()
            bar.update(runner.progress)

        async with client:
            runner = BatchRunner(
                client,
                state.batch_id,
                todo,
                sink,
                max_in_flight=args.max_in_flight,
                sent=state.sent,
                on_sent=state.record_sent,
                timeout_s=args.timeout,
                model=args.model or client.settings.gateway.model_name,
            )
            try:
                progress = await runner.run()
            except asyncio.CancelledError:  # Ctrl-C: every line written so far is whole
                bar.close()
                print(
                    f"\ninferline batch: interrupted after {runner.progress.done} lines this run; "
                    "requests already sent go on running, and the same command collects them and "
                    "sends the rest",
                    file=sys.stderr,
                )
                raise
    bar.close()
    return progress


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


async def drop_topic(client: InferenceClient, topic: str) -> None:
    admin = AIOKafkaAdminClient(**client.kafka.connection_options())
    with contextlib.suppress(Exception):
        await admin.start()
        await admin.delete_topics([topic])
    with contextlib.suppress(Exception):
        await admin.close()
