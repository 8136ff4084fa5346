"""A slow and a fast worker on one request topic: group mode against share mode.

    python -m bench.share_vs_group              # 40 requests x 16 tokens per mode
    python -m bench.share_vs_group --quick      # 8 requests x 4 tokens (a smoke run)

Both modes in one command, on a private broker (scripts/kafka.sh, Kafka 4.2.0: share groups).
Two `python -m inferline.worker` processes per mode: "fast" batches up to 16 requests, "slow" runs one at a
time (max_num_seqs 1, max_waiting 1): the same model on the same cores, slowed by giving up
batching. The request topic has 2 partitions, so in group mode each worker owns one and gets
about half of the requests, keyed by id; in share mode whichever worker has room takes the next
record (what it polled while full waits in it for room). Requests are produced one by one (as independent clients send them), all at once.
Latency: submit to the final `done` (its record timestamp). Prints, per mode, how many requests
each worker answered and the latency p50/p99/max; writes bench/results/share_vs_group.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from pathlib import Path

from inferline.contract.schema import DoneEvent
from tests.chaos_fixtures import PrivateBroker, ReplyWatcher, WorkerProcess, percentile, private_topics
from tests.worker_fixtures import Topics, submit, wait_log
from tests.worker_fixtures import request as make_request

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "share_vs_group.json"
KAFKA_VERSION = "4.2.0"
MODES = ("group", "share")
SCHEDULERS = {"fast": {"max_num_seqs": 16, "max_waiting": 16}, "slow": {"max_num_seqs": 1, "max_waiting": 1}}
# The slow worker is throttled too: one request at a time alone is not slow on 2 shared cores.
THROTTLE = {"slow": {"INFERLINE_FAULT_STEP_DELAY_S": "0.25"}}


async def make_topics(bootstrap: str) -> Topics:
    return await private_topics(bootstrap, "svg", 2, 2)


async def start_workers(mode: str, bootstrap: str, topics: Topics, log_dir: Path) -> list[WorkerProcess]:
    kafka = {"intake": mode, "group_id": f"svg-{mode}-{uuid.uuid4().hex[:6]}", "share_lock_ms": 60_000}
    workers = [WorkerProcess(name, bootstrap, topics, log_dir, worker={"name": name}, kafka=kafka, scheduler=sched)
               for name, sched in SCHEDULERS.items()]
    for w in workers:
        w.spawn(THROTTLE.get(w.name))
    await asyncio.gather(*(w.wait_started(600) for w in workers))
    if mode == "group":  # both must own a partition before the clock starts
        await asyncio.gather(*(wait_log(w.log_path, '"partitions": [', w.proc, 120) for w in workers))
        await asyncio.sleep(2.0)
    return workers


async def run_mode(mode: str, bootstrap: str, n: int, max_tokens: int, log_dir: Path) -> dict:
    topics = await make_topics(bootstrap)
    workers = await start_workers(mode, bootstrap, topics, log_dir)
    watcher = ReplyWatcher(bootstrap, topics.replies, 2)
    await watcher.start()
    try:
        sent = {}
        for i in range(n):
            req = make_request(topics.replies, prompt=f"Count: {i}", max_tokens=max_tokens, ignore_eos=True)
            sent[req["id"]] = time.time()
            await submit(bootstrap, topics.requests, [req])
        while watcher.finished(sent) < n:
            await asyncio.sleep(0.2)
        return summarize(mode, sent, watcher.events())
    finally:
        await watcher.stop()
        for w in workers:
            await w.terminate()


def summarize(mode: str, sent: dict[str, float], events: dict) -> dict:
    latency, served = [], {}
    for rid, t0 in sent.items():
        ts, done = next((ts, e) for ts, e in events[rid] if isinstance(e, DoneEvent) and e.finish_reason != "requeued")
        latency.append(ts - t0)
        served[done.worker] = served.get(done.worker, 0) + 1
    return {"mode": mode, "requests": len(sent), "served": served, "p50_s": round(percentile(latency, 50), 2),
            "p99_s": round(percentile(latency, 99), 2), "max_s": round(max(latency), 2)}


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    n, max_tokens = (8, 4) if args.quick else (args.requests, args.max_tokens)
    with tempfile.TemporaryDirectory(prefix="share-vs-group-") as tmp:
        broker = PrivateBroker(Path(tmp) / "kafka")
        broker.env["INFERLINE_KAFKA_VERSION"] = KAFKA_VERSION
        broker.start()
        try:
            results = [await run_mode(mode, broker.bootstrap, n, max_tokens, Path(tmp)) for mode in MODES]
        finally:
            broker.stop()
    for r in results:
        print(f"{r['mode']:>5}: served {r['served']}  latency p50 {r['p50_s']} s  p99 {r['p99_s']} s  max {r['max_s']} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"requests": n, "max_tokens": max_tokens, "results": results}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
