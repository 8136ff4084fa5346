"""A scaling step under steady load: a worker joins two (or one of three leaves, SIGTERM drain)
while long streaming requests run on an 8-partition request topic.

    python -m bench.scaling_step                          # join and leave, hold and requeue
    python -m bench.scaling_step --step join --rebalance hold --quick
    python -m bench.scaling_step --bootstrap localhost:9512   # a running broker, not a private one

`--rebalance requeue` is the behaviour before #37 (round-robin assignor, every revoked partition's
requests requeued); `hold` the default now. `--mode group` only: share mode's step is left to
`--mode share` (not built here). Per run it reports the running requests at the step, how many
were requeued (and on how many of the partitions that moved), the tokens computed twice (output
tokens of requeued attempts, and their prompts again), the TTFT p99 of requests sent during the
step, the rebalance (group not stable -> stable) and the recovery (step begin -> the last requeued
request running again). Writes bench/results/scaling_step.json. Figures: docs/benchmarks.md.

The scenario (`run_step`) is shared with tests/kafka/test_scaling_step.py, which asserts on it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.protocol import ConsumerProtocol
from aiokafka.errors import KafkaError

from inferline.contract.schema import DoneEvent, StartedEvent, TokensEvent
from tests.chaos_fixtures import PrivateBroker, ReplyWatcher, WorkerProcess, percentile, private_topics
from tests.kafka_fixtures import produce_raw
from tests.worker_fixtures import PROMPTS, Topics, wait_log
from tests.worker_fixtures import request as make_request

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "scaling_step.json"
PARTITIONS = 8
POLL_S = 0.1
# Long enough that a worker on a loaded 2-core machine is not dropped from the group meanwhile
# (the tests' 6 s default saw members evicted over and over).
SESSION_TIMEOUT_MS = 20_000


@dataclass
class Load:
    """What runs: `initial` requests per partition before the step, one more every `interval_s`
    while it lasts; each of `max_tokens` (ignore_eos)."""

    initial: int = 2
    max_tokens: int = 96
    interval_s: float = 1.0
    max_num_seqs: int = 8
    drain_timeout_s: float = 5.0


QUICK = Load(initial=1, max_tokens=32, interval_s=3.0, max_num_seqs=4)  # also tests/kafka/test_scaling_step.py


@dataclass
class StepRun:
    """What a step did: owners before/after, every request's partition, its submit time, its events."""

    step: str
    rebalance: str
    before: dict[int, str] = field(default_factory=dict)  # partition -> member id
    after: dict[int, str] = field(default_factory=dict)
    partition_of: dict[str, int] = field(default_factory=dict)
    sent_at: dict[str, float] = field(default_factory=dict)
    events: dict[str, list] = field(default_factory=dict)  # id -> [(timestamp s, event)]
    begin: float = 0.0  # the step starts (spawn of the joiner, SIGTERM of the leaver)
    unstable_at: float | None = None  # the group was first seen rebalancing
    stable_at: float | None = None  # ... and stable again with its new members

    @property
    def moved(self) -> set[int]:
        return {p for p in self.after if self.before.get(p) != self.after[p]}

    def requeued(self) -> dict[str, int]:
        """id -> partition of every request one of whose attempts was requeued."""
        return {i: self.partition_of[i] for i, evs in self.events.items()
                if any(isinstance(e, DoneEvent) and e.finish_reason == "requeued" for _, e in evs)}

    def finals(self, request_id: str) -> list[DoneEvent]:
        return [e for _, e in self.events.get(request_id, []) if isinstance(e, DoneEvent)
                and e.finish_reason != "requeued"]

    def ran_through(self) -> set[str]:
        """Requests started before the step whose final came after the group was stable again."""
        end = self.stable_at or self.begin
        return {i for i in self.running_at(self.begin)
                if max(ts for ts, e in self.events[i] if isinstance(e, DoneEvent)) > end}

    def running_at(self, t: float) -> set[str]:
        """Requests started before t whose final came after it."""
        out = set()
        for i, evs in self.events.items():
            started = [ts for ts, e in evs if isinstance(e, StartedEvent)]
            final = [ts for ts, e in evs if isinstance(e, DoneEvent) and e.finish_reason != "requeued"]
            if started and min(started) <= t and (not final or final[-1] > t):
                out.add(i)
        return out


# ------------------------------------------------------------------------------ the group, seen from outside

async def group_owners(bootstrap: str, group: str, members: int, timeout: float = 120.0) -> dict[int, str]:
    """partition -> member id, once the group is stable with `members` members owning every partition."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            state, owners = await _describe(admin, group)
            if state == "Stable" and len(set(owners.values())) == members and len(owners) == PARTITIONS:
                return owners
            if time.monotonic() > deadline:
                raise TimeoutError(f"group {group} not stable with {members} members: {state} {owners}")
            await asyncio.sleep(POLL_S)
    finally:
        await admin.close()


async def _describe(admin, group: str) -> tuple[str, dict[int, str]]:
    try:
        (response,) = await admin.describe_consumer_groups([group])
    except KafkaError:  # the coordinator moving or loading: not known now
        return "Unknown", {}
    owners: dict[int, str] = {}
    for g in response.groups:
        for m in g[5]:
            if m[-1]:
                for _topic, parts in ConsumerProtocol.ASSIGNMENT.decode(m[-1]).assignment:
                    owners.update({p: m[0] for p in parts})
        return g[2], owners
    return "Dead", owners


async def watch_rebalance(bootstrap: str, group: str, run: StepRun, members: int) -> None:
    """Marks when the group is first seen rebalancing after the step began and when it is stable
    again with `members` members (polled every POLL_S)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        while True:
            state, owners = await _describe(admin, group)
            now = time.time()
            if state != "Stable" and run.unstable_at is None:
                run.unstable_at = now
            if state == "Stable" and len(set(owners.values())) == members and len(owners) == PARTITIONS:
                if run.unstable_at is not None or set(owners.values()) != set(run.before.values()):
                    run.stable_at, run.after = now, owners
                    return
            await asyncio.sleep(POLL_S)
    finally:
        await admin.close()


# ------------------------------------------------------------------------------ the run

def _worker(name: str, bootstrap: str, topics: Topics, log_dir: Path, group: str, rebalance: str,
            load: Load) -> WorkerProcess:
    return WorkerProcess(name, bootstrap, topics, log_dir, worker={"name": name, "drain_timeout_s": load.drain_timeout_s},
                         kafka={"group_id": group, "rebalance": rebalance, "session_timeout_ms": SESSION_TIMEOUT_MS},
                         scheduler={"max_num_seqs": load.max_num_seqs, "max_waiting": 2 * load.max_num_seqs})


async def _send(bootstrap: str, topics: Topics, run: StepRun, partition: int, load: Load) -> None:
    req = make_request(topics.replies, PROMPTS[len(run.sent_at) % len(PROMPTS)], max_tokens=load.max_tokens,
                       ignore_eos=True)
    run.partition_of[req["id"]], run.sent_at[req["id"]] = partition, time.time()
    await produce_raw(bootstrap, topics.requests, [(req["id"].encode(), msgpack.packb(req))], partition=partition)


async def _steady(bootstrap: str, topics: Topics, run: StepRun, load: Load, stop: asyncio.Event) -> None:
    n = 0
    while not stop.is_set():
        await _send(bootstrap, topics, run, n % PARTITIONS, load)
        n += 1
        try:
            await asyncio.wait_for(stop.wait(), load.interval_s)
        except asyncio.TimeoutError:
            pass


async def _all_started(watcher: ReplyWatcher, ids, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while watcher.started(ids) < len(ids):
        assert time.monotonic() < deadline, "the initial requests never all started"
        await asyncio.sleep(POLL_S)


async def run_step(bootstrap: str, step: str, rebalance: str, log_dir: Path, load: Load | None = None) -> StepRun:
    """Two workers (join) or three (leave) serve `load`; once every initial request runs, a third
    joins (or the third leaves, SIGTERM); the load goes on through the step until the group is
    stable again, then every request is awaited to its final `done` (read_committed)."""
    load = load or Load()
    topics = await private_topics(bootstrap, "scale", PARTITIONS, PARTITIONS)
    group = f"scale-{uuid.uuid4().hex[:8]}"
    run = StepRun(step, rebalance)
    workers = {n: _worker(n, bootstrap, topics, log_dir, group, rebalance, load) for n in ("w1", "w2", "w3")}
    gate = log_dir / f"join-{group}"  # the joiner loads its model now, joins at the step
    for name, w in workers.items():
        w.spawn({"INFERLINE_FAULT_JOIN_GATE": str(gate)} if step == "join" and name == "w3" else None)
    joiner = workers.pop("w3") if step == "join" else None
    watcher = ReplyWatcher(bootstrap, topics.replies, PARTITIONS)
    stop = asyncio.Event()
    try:
        await asyncio.gather(*(w.wait_started(600) for w in workers.values()))
        if joiner is not None:
            await wait_log(joiner.log_path, '"worker.join_gate"', joiner.proc, 600)
        run.before = await group_owners(bootstrap, group, len(workers))
        await watcher.start()
        for p in range(PARTITIONS):
            for _ in range(load.initial):
                await _send(bootstrap, topics, run, p, load)
        await _all_started(watcher, list(run.sent_at))
        steady = asyncio.create_task(_steady(bootstrap, topics, run, load, stop))
        run.begin = time.time()
        members = len(workers) + (1 if step == "join" else -1)
        if joiner is not None:
            workers["w3"] = joiner
            gate.touch()
            await watch_rebalance(bootstrap, group, run, members)
        else:
            watching = asyncio.create_task(watch_rebalance(bootstrap, group, run, members))
            assert await workers["w3"].terminate() == 0
            await watching
        await asyncio.sleep(5.0)  # steady load a while past the step
        stop.set()
        await steady
        await _all_final(watcher, list(run.sent_at))
        run.events = watcher.events()
        return run
    finally:
        stop.set()
        await watcher.stop()
        for w in [*workers.values(), *([joiner] if joiner and "w3" not in workers else [])]:
            if w.alive():
                await w.terminate()


async def _all_final(watcher: ReplyWatcher, ids, timeout: float = 1200.0) -> None:
    deadline = time.monotonic() + timeout
    while watcher.finished(ids) < len(ids):
        assert time.monotonic() < deadline, f"{len(ids) - watcher.finished(ids)} requests never finished"
        await asyncio.sleep(0.5)
    await asyncio.sleep(2.0)  # a duplicate final would come about now


# ------------------------------------------------------------------------------ the figures

def figures(run: StepRun) -> dict:
    running = run.running_at(run.begin)
    requeued = run.requeued()
    end = run.stable_at or run.begin
    return {
        "step": run.step, "rebalance": run.rebalance, "partitions_moved": len(run.moved),
        "running_at_step": len(running), "requeued": len(requeued),
        "requeued_share": round(len(requeued) / len(running), 3) if running else None,
        "requeued_on_kept_partitions": sum(p not in run.moved for p in requeued.values()),
        "tokens_computed_twice": _twice(run, requeued),
        "ttft_p99_during_step_s": _ttft_p99(run, run.begin, end + 5.0),
        "rebalance_s": round(run.stable_at - run.unstable_at, 2) if run.unstable_at and run.stable_at else None,
        "recovery_s": _recovery(run, requeued),
        "finals_per_request": sorted({len(run.finals(i)) for i in run.sent_at}),
    }


def _twice(run: StepRun, requeued: dict[str, int]) -> dict:
    out = {"output": 0, "prompt": 0}
    for i in requeued:
        for _, e in run.events[i]:
            if isinstance(e, DoneEvent) and e.finish_reason == "requeued":
                out["output"] += e.usage.completion_tokens
                out["prompt"] += e.usage.prompt_tokens
    return out


def _ttft_p99(run: StepRun, start: float, end: float) -> float | None:
    """Submit to the first token of the final attempt, for requests sent during [start, end]."""
    ttfts = []
    for i, sent in run.sent_at.items():
        if not start <= sent <= end or not run.finals(i):
            continue
        attempt = run.finals(i)[-1].attempt
        first = min((ts for ts, e in run.events[i] if isinstance(e, TokensEvent) and e.attempt == attempt), default=None)
        if first is not None:
            ttfts.append(first - sent)
    return round(percentile(ttfts, 99), 2) if ttfts else None


def _recovery(run: StepRun, requeued: dict[str, int]) -> float | None:
    """Step begin to the last requeued request's final attempt streaming again."""
    restarts = []
    for i in requeued:
        attempt = run.finals(i)[-1].attempt
        first = min((ts for ts, e in run.events[i] if isinstance(e, TokensEvent) and e.attempt == attempt), default=None)
        if first is not None:
            restarts.append(first)
    return round(max(restarts) - run.begin, 2) if restarts else 0.0


# ------------------------------------------------------------------------------ command line

async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["group"], default="group", help="share: not built here")
    p.add_argument("--step", choices=["join", "leave"], nargs="+", default=["join", "leave"])
    p.add_argument("--rebalance", choices=["requeue", "hold"], nargs="+", default=["requeue", "hold"])
    p.add_argument("--bootstrap", help="a running broker (default: a private one, started and stopped here)")
    p.add_argument("--max-tokens", type=int, default=Load.max_tokens)
    p.add_argument("--quick", action="store_true", help="the tests' load: 1 request per partition, 32 tokens")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    load = QUICK if args.quick else Load(max_tokens=args.max_tokens)
    results = []
    with tempfile.TemporaryDirectory(prefix="scaling-step-") as tmp:
        broker = None
        if args.bootstrap is None:
            broker = PrivateBroker(Path(tmp) / "kafka")
            broker.start()
        bootstrap = args.bootstrap or broker.bootstrap
        try:
            for step in args.step:
                for rebalance in args.rebalance:
                    run = await run_step(bootstrap, step, rebalance, Path(tmp), load)
                    results.append(figures(run))
                    print(json.dumps(results[-1]), flush=True)
        finally:
            if broker is not None:
                broker.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"load": load.__dict__, "results": results}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
