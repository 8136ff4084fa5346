"""A scaling step in share mode under steady load: a third worker joins two, then one of the
three leaves (SIGTERM, drain).

    python -m bench.share_scaling                 # 2 requests every 3 s of 48 tokens, 60 s per phase
    python -m bench.share_scaling --quick         # shorter phases (a smoke run)

On a private broker (scripts/kafka.sh, Kafka 4.2.0: share groups), one request topic of one
partition, workers with small pools (max_num_seqs 4, max_waiting 4) so that two are saturated.
Requests are produced one by one at a steady rate. Per step it reports the requests running at
the step, how many of them were requeued, the tokens computed twice (output tokens of requeued
attempts plus their prompts again), the TTFT p99 (submit to the first `tokens` record) of
requests sent in the phase before the step and in the step's window, requests finished more
than once, and how long the step took (join: spawn to the joiner's first `started`; leave:
SIGTERM to exit). Writes bench/results/share_scaling.json. Figures: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from inferline.contract.schema import DoneEvent, StartedEvent, TokensEvent
from tests.chaos_fixtures import PrivateBroker, ReplyWatcher, WorkerProcess, percentile, private_topics
from tests.worker_fixtures import submit
from tests.worker_fixtures import request as make_request

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "share_scaling.json"
KAFKA_VERSION = "4.2.0"
POOL = {"max_num_seqs": 4, "max_waiting": 4}


@dataclass
class Load:
    per_tick: int = 2
    interval_s: float = 3.0
    max_tokens: int = 48
    phase_s: float = 60.0  # load before the join, between the steps, after the leave
    drain_timeout_s: float = 5.0


def spawn(name: str, bootstrap: str, topics, log_dir: Path, group: str, load: Load) -> WorkerProcess:
    w = WorkerProcess(name, bootstrap, topics, log_dir, worker={"name": name, "drain_timeout_s": load.drain_timeout_s},
                      kafka={"intake": "share", "group_id": group}, scheduler=POOL)
    w.spawn()
    return w


async def steady_load(bootstrap: str, topics, load: Load, sent: dict[str, float], stop: asyncio.Event) -> None:
    """`per_tick` requests, one produce each, every `interval_s` until stopped."""
    i = 0
    while not stop.is_set():
        for _ in range(load.per_tick):
            req = make_request(topics.replies, prompt=f"Count: {i}", max_tokens=load.max_tokens, ignore_eos=True)
            sent[req["id"]] = time.time()
            await submit(bootstrap, topics.requests, [req])
            i += 1
        try:
            await asyncio.wait_for(stop.wait(), load.interval_s)
        except asyncio.TimeoutError:
            pass


def running_at(events: dict, t: float) -> set[str]:
    """Requests with an attempt started before t and no final `done` before it."""
    out = set()
    for rid, evs in events.items():
        started = [ts for ts, e in evs if isinstance(e, StartedEvent)]
        finals = [ts for ts, e in evs if isinstance(e, DoneEvent) and e.finish_reason != "requeued"]
        if started and min(started) <= t and not any(ts <= t for ts in finals):
            out.add(rid)
    return out


def requeued_in(events: dict, t0: float, t1: float) -> list[DoneEvent]:
    return [e for evs in events.values() for ts, e in evs
            if isinstance(e, DoneEvent) and e.finish_reason == "requeued" and t0 <= ts <= t1]


def ttft_p99(events: dict, sent: dict[str, float], t0: float, t1: float) -> float | None:
    """Submit to the first `tokens` record, of requests sent in [t0, t1)."""
    ttfts = []
    for rid, at in sent.items():
        if t0 <= at < t1:
            first = [ts for ts, e in events.get(rid, []) if isinstance(e, TokensEvent)]
            if first:
                ttfts.append(min(first) - at)
    return round(percentile(ttfts, 99), 2) if ttfts else None


def step_report(name: str, events: dict, sent: dict, begin: float, end: float, before: float) -> dict:
    running = running_at(events, begin)
    requeued = requeued_in(events, begin, end)
    return {"step": name, "running_at_step": len(running),
            "requeued": len({e.id for e in requeued}),
            "requeued_share": round(len({e.id for e in requeued} & running) / len(running), 3) if running else 0.0,
            "tokens_computed_twice": sum(e.usage.completion_tokens + e.usage.prompt_tokens for e in requeued),
            "ttft_p99_before_s": ttft_p99(events, sent, before, begin),
            "ttft_p99_step_s": ttft_p99(events, sent, begin, end), "step_s": None}


async def run(bootstrap: str, load: Load, log_dir: Path) -> dict:
    topics = await private_topics(bootstrap, "sscale", 1, 2)
    group = f"sscale-{uuid.uuid4().hex[:6]}"
    workers = [spawn(f"w{i}", bootstrap, topics, log_dir, group, load) for i in range(2)]
    await asyncio.gather(*(w.wait_started(600) for w in workers))
    watcher = ReplyWatcher(bootstrap, topics.replies, 2)
    await watcher.start()
    sent: dict[str, float] = {}
    stop = asyncio.Event()
    producer = asyncio.create_task(steady_load(bootstrap, topics, load, sent, stop))
    try:
        t_start = time.time()
        await asyncio.sleep(load.phase_s)
        join_at = time.time()
        joiner = spawn("w2", bootstrap, topics, log_dir, group, load)
        workers.append(joiner)
        await joiner.wait_started(600)
        while not any(e.worker == "w2" for evs in watcher.events().values() for _, e in evs
                      if isinstance(e, StartedEvent)):
            await asyncio.sleep(0.2)
        joined = time.time()
        await asyncio.sleep(max(0.0, load.phase_s - (joined - join_at)))
        leave_at = time.time()
        await workers[0].terminate()
        left = time.time()
        await asyncio.sleep(load.phase_s)
        stop.set()
        await producer
        while watcher.finished(sent) < len(sent):
            await asyncio.sleep(0.5)
        events = watcher.events()
        join = step_report("join", events, sent, join_at, joined + load.phase_s / 2, t_start)
        join["step_s"] = round(joined - join_at, 1)
        leave = step_report("leave", events, sent, leave_at, left + load.phase_s / 2, join_at)
        leave["step_s"] = round(left - leave_at, 1)
        return summary(events, sent, [join, leave], load)
    finally:
        stop.set()
        await watcher.stop()
        for w in workers:
            if w.alive():
                await w.terminate()


def summary(events: dict, sent: dict, steps: list[dict], load: Load) -> dict:
    finals = {rid: [e for _, e in events[rid] if isinstance(e, DoneEvent) and e.finish_reason != "requeued"]
              for rid in sent}
    served: dict[str, int] = {}
    for fs in finals.values():
        served[fs[-1].worker] = served.get(fs[-1].worker, 0) + 1
    return {"load": load.__dict__, "requests": len(sent), "served": served, "steps": steps,
            "finished_more_than_once": sum(len(fs) > 1 for fs in finals.values()),
            "rejected": sum(fs[-1].finish_reason == "rejected" for fs in finals.values())}


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--phase-s", type=float, default=Load.phase_s)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    load = Load(phase_s=20.0, max_tokens=16) if args.quick else Load(phase_s=args.phase_s)
    with tempfile.TemporaryDirectory(prefix="share-scaling-") as tmp:
        broker = PrivateBroker(Path(tmp) / "kafka")
        broker.env["INFERLINE_KAFKA_VERSION"] = KAFKA_VERSION
        broker.start()
        try:
            result = await run(broker.bootstrap, load, Path(tmp))
        finally:
            broker.stop()
    for s in result["steps"]:
        print(f"{s['step']:>5}: running {s['running_at_step']}  requeued {s['requeued']} ({s['requeued_share']:.0%})"
              f"  tokens twice {s['tokens_computed_twice']}  TTFT p99 before {s['ttft_p99_before_s']} s,"
              f" step {s['ttft_p99_step_s']} s  step {s['step_s']} s")
    print(f"requests {result['requests']}  served {result['served']}  finished twice {result['finished_more_than_once']}"
          f"  rejected {result['rejected']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
