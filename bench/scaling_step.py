"""A scaling step under steady load: a worker joins two, or one of three leaves (SIGTERM, drain).

    python -m bench.scaling_step                         # group mode: join, leave
    python -m bench.scaling_step --step join --quick
    python -m bench.scaling_step --mode share            # share mode (a private Kafka 4.2 broker)

Long streaming requests run on 8 partitions (group) or one (share: whichever worker has room takes
the next record); the joiner loads its model first and joins at the step. Group mode rebalances
incrementally (KIP-848): only the requests of partitions that moved are requeued. Per step: the
requests running at it, how many were requeued, the tokens computed twice (output of requeued
attempts and their prompts again), the TTFT p99 of requests sent during the step, requests
finished more than once, and how long the step took (group: to stable again; share: to the
joiner's first `started`, or to the leaver's exit). Writes bench/results/scaling_step.json.
tests/kafka/test_scaling_step.py asserts on `run_step`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
from confluent_kafka import ConsumerGroupState
from confluent_kafka.admin import AdminClient

from bench import stats
from inferline.contract.schema import DoneEvent, StartedEvent, TokensEvent
from tests.chaos_fixtures import PrivateBroker, ReplyWatcher, WorkerProcess, private_topics
from tests.kafka_fixtures import produce_raw
from tests.worker_fixtures import PROMPTS, Topics, wait_log
from tests.worker_fixtures import request as make_request

PARTITIONS = 8
POLL_S = 0.1
# Long enough that a worker on a loaded 2-core machine is not dropped from the group meanwhile
# (the tests' 6 s default saw members evicted over and over).
SESSION_TIMEOUT_MS = 20_000


@dataclass
class Load:
    """`initial` requests per partition before the step, one more every `interval_s` through it;
    each of `max_tokens` (ignore_eos). `step_delay_s` > 0 makes each engine step at least that
    long (INFERLINE_FAULT_STEP_DELAY_S), so a request outlasts the step on any machine."""

    initial: int = 2
    max_tokens: int = 96
    interval_s: float = 1.0
    max_num_seqs: int = 8
    drain_timeout_s: float = 5.0
    step_delay_s: float = 0.0


# The test's: 32 tokens of at least 0.4 s each, so the requests running at the step are still
# running when the group is stable again (>= 12.8 s; a step took 2-10 s on 2 loaded cores).
QUICK = Load(initial=1, max_tokens=32, interval_s=3.0, max_num_seqs=4, step_delay_s=0.4)
SHARE = Load(initial=12, max_tokens=48, max_num_seqs=4)  # one partition: two workers saturated


# ---- the figures, from every request's events: id -> [(timestamp s, event)] --------------------


def dones(evs: list, requeued: bool = False, t0: float = 0.0, t1: float = float("inf")) -> list:
    """The final `done`s of one request's events (or its `requeued` ones) within [t0, t1]."""
    return [
        e
        for ts, e in evs
        if isinstance(e, DoneEvent)
        and t0 <= ts <= t1
        and (e.finish_reason == "requeued") == requeued
    ]


def finals(evs: list) -> list[DoneEvent]:
    return dones(evs)


def running_at(events: dict, t: float) -> set[str]:
    """Requests started at t whose final came after it."""
    return {
        i
        for i, evs in events.items()
        if not dones(evs, t1=t) and any(isinstance(e, StartedEvent) and ts <= t for ts, e in evs)
    }


def requeues(events: dict, t0: float = 0.0, t1: float = float("inf")) -> dict[str, list[DoneEvent]]:
    """id -> its attempts ended `requeued` within [t0, t1]."""
    return {i: r for i, evs in events.items() if (r := dones(evs, True, t0, t1))}


def ttft_p99(events: dict, sent: dict[str, float], t0: float, t1: float) -> float | None:
    """Submit to the first token of the final attempt, of requests sent in [t0, t1]."""
    ttfts = []
    for i, at in sent.items():
        if t0 <= at <= t1 and finals(events.get(i, [])):
            attempt = finals(events[i])[-1].attempt
            first = [
                ts for ts, e in events[i] if isinstance(e, TokensEvent) and e.attempt == attempt
            ]
            ttfts += [min(first) - at] if first else []
    return round(stats.pct(ttfts, 99), 2) if ttfts else None


def step_figures(events: dict, sent: dict, begin: float, end: float) -> dict:
    running, requeued = running_at(events, begin), requeues(events, begin, end)
    share = len(set(requeued) & running) / len(running) if running else 0
    return {
        "running_at_step": len(running),
        "requeued": len(requeued),
        "requeued_share": round(share, 3),
        "tokens_computed_twice": sum(
            e.usage.completion_tokens + e.usage.prompt_tokens
            for es in requeued.values()
            for e in es
        ),
        "ttft_p99_step_s": ttft_p99(events, sent, begin, end),
        "finished_more_than_once": sum(len(finals(events.get(i, []))) > 1 for i in sent),
    }


# ---- group mode -------------------------------------------------------------------------------


@dataclass
class StepRun:
    """A group step: owners before and after, every request's partition, submit time, events."""

    step: str
    rebalance: str
    before: dict[int, str] = field(default_factory=dict)  # partition -> member id
    after: dict[int, str] = field(default_factory=dict)
    partition_of: dict[str, int] = field(default_factory=dict)
    sent_at: dict[str, float] = field(default_factory=dict)
    events: dict[str, list] = field(default_factory=dict)
    begin: float = 0.0  # the step starts (spawn of the joiner, SIGTERM of the leaver)
    unstable_at: float | None = None  # the group was first seen rebalancing
    stable_at: float | None = None  # ... and stable again with its new members

    @property
    def moved(self) -> set[int]:
        return {p for p in self.after if self.before.get(p) != self.after[p]}

    def requeued(self) -> dict[str, int]:
        """id -> partition of every request one of whose attempts was requeued."""
        return {i: self.partition_of[i] for i in requeues(self.events)}

    def finals(self, request_id: str) -> list[DoneEvent]:
        return finals(self.events.get(request_id, []))

    def running_at(self, t: float) -> set[str]:
        return running_at(self.events, t)

    def ran_through(self) -> set[str]:
        """Requests started before the step whose final came after the group was stable again."""
        end = self.stable_at or self.begin
        return {
            i
            for i in self.running_at(self.begin)
            if max(ts for ts, e in self.events[i] if isinstance(e, DoneEvent)) > end
        }


def group_owners(admin, group: str) -> tuple[str, dict[int, str]]:
    """Blocking: the group's state and each partition's member (ConsumerGroupDescribe: the
    classic DescribeGroups does not see KIP-848 groups)."""
    try:
        g = admin.describe_consumer_groups([group])[group].result(timeout=10)
    except Exception:  # noqa: BLE001 - the coordinator moving or loading: not known now
        return "Unknown", {}
    owners = {
        p.partition: m.member_id
        for m in g.members
        if m.assignment is not None
        for p in m.assignment.topic_partitions
    }
    return ("Stable" if g.state == ConsumerGroupState.STABLE else str(g.state)), owners


async def watch_group(
    bootstrap: str, group: str, members: int, run: StepRun | None = None, timeout: float = 600.0
) -> dict[int, str]:
    """Polls until the group is stable with `members` members owning every partition (after a
    rebalance, with `run`: its unstable and stable times are marked); returns the owners."""
    admin, deadline = AdminClient({"bootstrap.servers": bootstrap}), time.monotonic() + timeout
    while time.monotonic() < deadline:
        state, owners = await asyncio.to_thread(group_owners, admin, group)
        if run is not None and state != "Stable" and run.unstable_at is None:
            run.unstable_at = time.time()
        stable = (
            state == "Stable" and len(owners) == PARTITIONS and len(set(owners.values())) == members
        )
        if stable and (
            run is None
            or run.unstable_at is not None
            or set(owners.values()) != set(run.before.values())
        ):
            if run is not None:
                run.stable_at, run.after = time.time(), owners
            return owners
        await asyncio.sleep(POLL_S)
    raise TimeoutError(f"group {group} not stable with {members} members")


async def send(bootstrap: str, topics: Topics, run: StepRun, partition: int, load: Load) -> None:
    req = make_request(
        topics.replies,
        PROMPTS[len(run.sent_at) % len(PROMPTS)],
        max_tokens=load.max_tokens,
        ignore_eos=True,
    )
    run.partition_of[req["id"]], run.sent_at[req["id"]] = partition, time.time()
    await produce_raw(
        bootstrap, topics.requests, [(req["id"].encode(), msgpack.packb(req))], partition=partition
    )


async def steady(load: Load, stop: asyncio.Event, send_one) -> None:
    """`send_one(n)` every `load.interval_s` until stopped."""
    n = 0
    while not stop.is_set():
        await send_one(n)
        n += 1
        try:
            await asyncio.wait_for(stop.wait(), load.interval_s)
        except TimeoutError:
            pass


async def until(check, what: str, timeout: float = 1200.0, poll: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(poll)


async def run_step(
    bootstrap: str,
    step: str,
    rebalance: str,
    log_dir: Path,
    load: Load | None = None,
    mode: str = "group",
) -> StepRun:
    """Two workers (join) or three (leave) serve `load`; once the initial requests run, a third
    joins (or the third leaves, SIGTERM); the load goes on through the step (group: until the
    group is stable again), then every request is awaited to its final `done` (read_committed)."""
    load, share = load or Load(), mode == "share"
    partitions = 1 if share else PARTITIONS
    topics = await private_topics(bootstrap, "scale", partitions, partitions)
    group, run = f"scale-{uuid.uuid4().hex[:8]}", StepRun(step, rebalance)
    kafka = {"intake": "share"} if share else {"session_timeout_ms": SESSION_TIMEOUT_MS}
    workers = {
        n: WorkerProcess(
            n,
            bootstrap,
            topics,
            log_dir,
            kafka={"group_id": group, **kafka},
            worker={"name": n, "drain_timeout_s": load.drain_timeout_s},
            scheduler={
                "max_num_seqs": load.max_num_seqs,
                "max_waiting": load.max_num_seqs * (1 if share else 2),
            },
        )
        for n in ("w1", "w2", "w3")
    }
    gate = log_dir / f"join-{group}"  # the joiner loads its model now, joins at the step
    paced = {"INFERLINE_FAULT_STEP_DELAY_S": str(load.step_delay_s)} if load.step_delay_s else {}
    for name, w in workers.items():
        joins = step == "join" and name == "w3"
        w.spawn({**paced, "INFERLINE_FAULT_JOIN_GATE": str(gate)} if joins else paced)
    joiner = workers.pop("w3") if step == "join" else None
    watcher, stop = ReplyWatcher(bootstrap, topics.replies, partitions), asyncio.Event()
    try:
        await asyncio.gather(*(w.wait_started(600) for w in workers.values()))
        if joiner is not None:
            await wait_log(joiner.log_path, '"worker.join_gate"', joiner.proc, 600)
        if not share:
            run.before = await watch_group(bootstrap, group, len(workers), timeout=120)
        await watcher.start()
        for p in range(partitions):
            for _ in range(load.initial):
                await send(bootstrap, topics, run, p, load)
        # Every initial request runs (share: as many as the workers' seats hold).
        running = min(len(run.sent_at), len(workers) * load.max_num_seqs)
        await until(
            lambda: watcher.started(list(run.sent_at)) >= running,
            "the initial requests never started",
            300,
            POLL_S,
        )
        load_task = asyncio.create_task(
            steady(load, stop, lambda n: send(bootstrap, topics, run, n % partitions, load))
        )
        run.begin = time.time()
        members = len(workers) + (1 if step == "join" else -1)
        if not share:
            watching = asyncio.create_task(watch_group(bootstrap, group, members, run))
        if joiner is not None:
            workers["w3"] = joiner
            gate.touch()
        else:
            assert await workers["w3"].terminate() == 0
        if not share:
            await watching
        elif joiner is not None:
            await until(lambda: joined(watcher), "the joiner never started a request", 900, POLL_S)
        run.stable_at = run.stable_at or time.time()
        await asyncio.sleep(5.0)  # steady load a while past the step
        stop.set()
        await load_task
        ids = list(run.sent_at)
        await until(lambda: watcher.finished(ids) == len(ids), "requests never finished")
        await asyncio.sleep(2.0)  # a duplicate final would come about now
        run.events = watcher.events()
        return run
    finally:
        stop.set()
        await watcher.stop()
        for w in {*workers.values(), *([joiner] if joiner else [])}:
            if w.alive():
                await w.terminate()


def joined(watcher: ReplyWatcher) -> bool:
    """The joiner (w3) started a request."""
    return any(
        isinstance(e, StartedEvent) and e.worker == "w3"
        for evs in watcher.events().values()
        for _, e in evs
    )


def figures(run: StepRun, mode: str) -> dict:
    end, requeued = run.stable_at or run.begin, run.requeued()
    out = {
        "mode": mode,
        "step": run.step,
        "step_s": round(end - run.begin, 2),
        **step_figures(run.events, run.sent_at, run.begin, end + 5.0),
    }
    if mode == "group":
        out.update(
            rebalance=run.rebalance,
            partitions_moved=len(run.moved),
            requeued_on_kept_partitions=sum(p not in run.moved for p in requeued.values()),
        )
    return out


# ---- command line -----------------------------------------------------------------------------


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["group", "share"], default="group")
    p.add_argument("--step", choices=["join", "leave"], nargs="+", default=["join", "leave"])
    p.add_argument("--max-tokens", type=int, default=Load.max_tokens)
    p.add_argument("--quick", action="store_true", help="the test's load, shorter")
    p.add_argument("--out", type=Path, default=stats.RESULTS / "scaling_step.json")
    args = p.parse_args()
    share = args.mode == "share"
    load = SHARE if share else QUICK if args.quick else Load(max_tokens=args.max_tokens)
    if share and args.quick:
        load = Load(**{**QUICK.__dict__, "initial": SHARE.initial})
    results = []
    with tempfile.TemporaryDirectory(prefix="scaling-step-") as tmp:
        broker = PrivateBroker(Path(tmp) / "kafka")
        if share:
            broker.env["INFERLINE_KAFKA_VERSION"] = "4.2.0"  # share groups
        broker.start()
        try:
            rebalances = ["share"] if share else ["incremental"]
            for step, rebalance in itertools.product(args.step, rebalances):
                run = await run_step(broker.bootstrap, step, rebalance, Path(tmp), load, args.mode)
                results.append(figures(run, args.mode))
                print(json.dumps(results[-1]), flush=True)
        finally:
            broker.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"load": load.__dict__, "results": results}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
