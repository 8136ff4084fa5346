"""Fixtures and helpers for the worker's broker-backed tests.

    topics (function, async) -> Topics          fresh request/cancel/dlq/reply topics
    start_worker (function, async) -> factory   `w = await start_worker(topics, scheduler={...})`
        runs a Worker in this process on an engine over the session's shared ModelRunner (one
        model load per session) and waits until it is in the group; stopped after the test.
    spawn_worker(...)         `python -m inferline.worker` as a subprocess (kill/restart)

Requests are raw msgpack maps (so malformed ones are easy to write); events come back decoded
and grouped by request id with `collect()`, and `check_attempts()` asserts the contract's
shape of every attempt: `started` first (if it ran), seq 0..n with no gaps, one final `done`.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest

from inferline.config.settings import Settings
from inferline.contract.schema import DoneEvent, StartedEvent, TokensEvent, decode_event
from tests.kafka_fixtures import consume_until, produce_raw
from inferline.worker.app import Worker, engine_settings
from inferline.worker.engine.engine import LLMEngine

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Explain Kafka in one sentence.",
    "What is 2+2?",
    "Name a colour.",
    "Say hello.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Count to five.",
    "Why is the sky blue?",
]


@dataclass
class Topics:
    requests: str
    cancel: str
    dlq: str
    replies: str


@pytest.fixture
async def topics(new_topic) -> Topics:
    return Topics(
        requests=await new_topic(2, prefix="req"),
        cancel=await new_topic(1, prefix="cancel"),
        dlq=await new_topic(1, prefix="dlq"),
        replies=await new_topic(2, prefix="reply", reply=True),
    )


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def worker_config(bootstrap: str, topics: Topics, **overrides) -> dict:
    """Settings for a test worker as a nested dict: small batches, fast flushes, quick timeouts."""
    base = {
        "kafka": {
            "bootstrap_servers": bootstrap,
            "request_topic": topics.requests,
            "cancel_topic": topics.cancel,
            "dlq_topic": topics.dlq,
            "group_id": f"g-{uuid.uuid4().hex[:8]}",
            "session_timeout_ms": 6000,
            "flush_interval_ms": 20,
        },
        "model": {"device": "cpu", "max_model_len": 512},
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 256, "max_waiting": 64},
        "http": {"host": "127.0.0.1", "port": 0},
        "worker": {"drain_timeout_s": 20},
    }
    return _merge(base, overrides)


def config_env(config: dict, prefix: str = "INFERLINE_") -> dict[str, str]:
    """The INFERLINE_* variables that say the same as a nested settings dict."""
    env = {}
    for key, value in config.items():
        name = f"{prefix}{key.upper()}"
        if isinstance(value, dict):
            env.update(config_env(value, name + "__"))
        elif value is not None:
            env[name] = str(value)
    return env


@pytest.fixture
async def start_worker(kafka_bootstrap, model_runner):
    running: list[tuple[Worker, asyncio.Task]] = []

    async def start(topics: Topics, ready: bool = True, **overrides) -> Worker:
        """`ready=False`: returns at once, the worker starting in a task (`worker.task`)."""
        settings = Settings(**worker_config(kafka_bootstrap, topics, **overrides))
        worker = Worker(settings, LLMEngine(model_runner, engine_settings(settings)))
        worker.task = task = asyncio.create_task(worker.run())
        running.append((worker, task))
        if ready:
            await wait_ready(worker, task)
        return worker

    yield start
    for worker, task in reversed(running):
        worker.request_stop()
        await asyncio.wait_for(task, 60)


async def wait_ready(worker: Worker, task: asyncio.Task, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    # The loop-side state: a call into the consumer from here could wait for the rebalance
    # callback, which waits for this loop.
    while not (all(worker.readiness().values()) and worker.tracker.owned()):
        if task.done():
            task.result()  # raises what killed it
            raise RuntimeError("worker stopped before it was ready")
        assert time.monotonic() < deadline, f"worker not ready: {worker.readiness()}"
        await asyncio.sleep(0.05)


def spawn_worker(
    bootstrap: str, topics: Topics, log_path: Path, env_extra: dict | None = None, **overrides
) -> subprocess.Popen:
    """`python -m inferline.worker` with INFERLINE_* settings (and `env_extra`); its logs (JSON
    lines) go to log_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERLINE_")}
    env.update(config_env(worker_config(bootstrap, topics, **overrides)))
    env["INFERLINE_LOG__FORMAT"] = "json"
    env.update(env_extra or {})
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-P", "-m", "inferline.worker"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


async def wait_log(
    log_path: Path, needle: str, proc: subprocess.Popen, timeout: float = 90.0
) -> None:
    deadline = time.monotonic() + timeout
    while needle not in log_path.read_text(errors="replace"):
        assert proc.poll() is None, (
            f"worker exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
        )
        assert time.monotonic() < deadline, (
            f"no {needle!r} in the worker log:\n{log_path.read_text()[-3000:]}"
        )
        await asyncio.sleep(0.2)


# ---------------------------------------------------------------------------- requests and events


def request(
    reply_topic: str,
    prompt: str = PROMPTS[0],
    *,
    id: str | None = None,
    max_tokens: int = 8,
    temperature: float = 0.0,
    **fields,
) -> dict:
    return {
        "v": 1,
        "id": id or f"r-{uuid.uuid4().hex[:12]}",
        "reply_topic": reply_topic,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        **fields,
    }


async def submit(bootstrap: str, topic: str, requests: list[dict]) -> list[str]:
    await produce_raw(bootstrap, topic, [(r["id"].encode(), msgpack.packb(r)) for r in requests])
    return [r["id"] for r in requests]


async def submit_raw(bootstrap: str, topic: str, values: list[bytes], key: bytes | None = None):
    return await produce_raw(bootstrap, topic, values, key=key)


async def cancel(bootstrap: str, topic: str, request_id: str) -> None:
    await produce_raw(
        bootstrap, topic, [(request_id.encode(), msgpack.packb({"v": 1, "id": request_id}))]
    )


def final_done(events: list) -> DoneEvent | None:
    """The `done` of the latest attempt that is not `requeued`, if any."""
    finals = [e for e in events if isinstance(e, DoneEvent) and e.finish_reason != "requeued"]
    return finals[-1] if finals else None


class Replies(dict):
    """request id -> its events in order; `.partitions[id]` the reply partitions they came on."""

    partitions: dict[str, set[int]]


def _group(records) -> Replies:
    out, parts = Replies(), defaultdict(set)
    for r in records:
        ev = decode_event(r.value)
        out.setdefault(ev.id, []).append(ev)
        parts[ev.id].add(r.partition)
    out.partitions = dict(parts)
    return out


async def collect(
    bootstrap: str,
    reply_topic: str,
    ids,
    timeout: float = 120.0,
    dones: dict[str, int] | None = None,
) -> Replies:
    """Reads the reply topic until every id has a final (non-requeued) `done`, and every id of
    `dones` at least that many `done` events (a final sent again comes on its own partition)."""
    wanted, dones = set(ids), dones or {}

    def complete(records) -> bool:
        events = _group(records)
        return all(final_done(events.get(i, [])) is not None for i in wanted) and all(
            sum(isinstance(e, DoneEvent) for e in events.get(i, [])) >= n for i, n in dones.items()
        )

    return _group(await consume_until(bootstrap, reply_topic, complete, timeout=timeout))


def attempts_of(events: list) -> dict[str, list]:
    out = defaultdict(list)
    for ev in events:
        out[ev.attempt].append(ev)
    return out


def check_attempts(events: list, allow_cut: bool = False) -> None:
    """Every attempt: seq 0..n without gaps, `started` (if any) first, exactly one `done`, last.
    With allow_cut, an attempt may stop without a `done` (its worker was killed)."""
    for attempt, evs in attempts_of(events).items():
        assert [e.seq for e in evs] == list(range(len(evs))), (
            f"seq gap in {attempt}: {[e.seq for e in evs]}"
        )
        dones = [e for e in evs if isinstance(e, DoneEvent)]
        if not (allow_cut and not dones):
            assert len(dones) == 1 and evs[-1] is dones[0], (
                f"attempt {attempt} must end with one done"
            )
        started = [e for e in evs if isinstance(e, StartedEvent)]
        assert len(started) <= 1 and (not started or evs[0] is started[0])
        if any(isinstance(e, TokensEvent) for e in evs):
            assert started, "tokens without started"


def final_dones(events: list) -> list[DoneEvent]:
    return [e for e in events if isinstance(e, DoneEvent) and e.finish_reason != "requeued"]


def streamed_text(events: list) -> str:
    """The text of the final attempt as streamed in `tokens` events."""
    done = final_done(events)
    return "".join(
        e.text for e in events if isinstance(e, TokensEvent) and e.attempt == done.attempt
    )
