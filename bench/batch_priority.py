"""Batch work beside interactive work on one worker: does the batch yield? One command, three loads:

    python -m bench.batch_priority                    # 1,000 batch lines, interactive 2 req/s for 60 s
    python -m bench.batch_priority --quick            # 120 lines, 20 interactive requests (a smoke run)

1. interactive alone: a steady Poisson load of short streamed chat requests (priority 0); its
   TTFT p50/p99 (client side: submit to first text) and its output tokens/s;
2. batch alone: the batch (priority 100, the BatchRunner of `inferline batch run`, bounded in
   flight) on the idle worker: its output tokens/s is the worker's capacity for this work;
3. both: the batch running, then the same interactive load beside it: the interactive TTFT
   p50/p99 again, and the batch's output tokens/s during the interactive window.

Each round runs on a fresh worker, once per `--background` mode: `off` (every priority shares each
step alike) and `on` (the scheduler's BackgroundLimit as configured: batch sequences in turns
beside interactive work), so the two are compared within one command.

Targets (issue 40): interactive TTFT p99 with the batch within +25% of alone; the batch uses at
least 70% of the idle capacity, (2) minus the interactive load's own tokens/s from (1). Also
reported: the idle capacity read by engine time, (2) times the share of (1)'s wall time the
engine spent outside steps (its /metrics `inferline_iteration_seconds`): on a CPU a light
interactive load keeps the engine busy most of the time in short steps.
One broker (`scripts/kafka.sh acquire`), one `python -m inferline.worker` subprocess on fresh topics.
Writes bench/results/batch_priority.json (--out).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

from bench import kafka_e2e as e2e
from bench.read_committed import cpu_model

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "batch_priority.json"
TARGETS = {"ttft_p99_ratio_max": 1.25, "idle_capacity_used_min": 0.70}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.batch_priority", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-lines", type=int, default=1000)
    p.add_argument("--batch-tokens", type=int, default=32, help="max_tokens of each batch line")
    p.add_argument("--max-in-flight", type=int, default=64, help="the batch's requests in flight")
    p.add_argument("--rate", type=float, default=2.0, help="interactive requests/s (Poisson)")
    p.add_argument("--interactive", type=int, default=120, help="interactive requests per load")
    p.add_argument("--interactive-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=0, help="the worker's torch threads (0: torch's choice)")
    p.add_argument("--background", default="off,on",
                   help="rounds, each on a fresh worker: the scheduler's background limit off, on (as "
                        "configured), on:N (N background tokens a step beside interactive work), on:N:M "
                        "(and M a step between interactive requests), on:N:M:Q (until Q s without "
                        "interactive work), comma-separated")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.quick:
        args.batch_lines, args.interactive, args.batch_tokens = 120, 20, 16
    args.flush_interval_ms = None
    return args


def batch_lines(n: int, tokens: int):
    from inferline.producer.batch.lines import parse_lines

    text = "\n".join(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"messages": [{"role": "user", "content": f"Write a short note about item {i}."}],
                                          "max_tokens": tokens, "temperature": 0, "ignore_eos": True}})
                     for i in range(n))
    return parse_lines(text)


class BatchLoad:
    """A BatchRunner in this process; (finish time, completion tokens) of every line."""

    def __init__(self, client, lines, max_in_flight: int):
        from inferline.producer.batch.runner import BatchRunner

        self.finished: list[tuple[float, int]] = []
        self.runner = BatchRunner(client, f"batch_{uuid.uuid4().hex[:12]}", lines, self._sink,
                                  max_in_flight=max_in_flight)

    def _sink(self, _line, out, tokens: int) -> None:
        assert out["error"] is None and out["response"]["status_code"] == 200, out
        self.finished.append((time.monotonic(), tokens))

    def tokens_between(self, t0: float, t1: float) -> int:
        return sum(n for t, n in self.finished if t0 <= t < t1)


async def interactive(client, args, rng: random.Random) -> dict:
    """Poisson arrivals of short streamed chats at priority 0; TTFT and tokens/s."""
    async def one(i: int):
        handle = await client.submit(messages=[{"role": "user", "content": f"Say something about {i}."}],
                                     max_tokens=args.interactive_tokens, temperature=0, ignore_eos=True)
        return await handle.result()

    tasks, t0 = [], time.monotonic()
    for i in range(args.interactive):
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(rng.expovariate(args.rate))
    results = await asyncio.gather(*tasks)
    t1 = time.monotonic()
    ttfts = sorted(r.client_ttft_s for r in results)
    return {"t0": t0, "t1": t1, "requests": len(results), "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "output_tokens_per_s": sum(r.usage.completion_tokens for r in results) / (t1 - t0)}


def engine_busy_s(port: int | None) -> float | None:
    """Seconds the worker's engine has spent in steps (its inferline_iteration_seconds sum)."""
    return None if port is None else e2e.metric_values(port).get("inferline_iteration_seconds_sum", 0.0)


async def run_all(args, settings, topics, port: int | None = None) -> dict:
    from inferline.producer.client import InferenceClient

    client = InferenceClient(settings=settings, request_topic=topics.requests, cancel_topic=topics.cancel,
                             reply_topic=f"{settings.kafka.reply_topic_prefix}bench-{uuid.uuid4().hex[:8]}")
    async with client:
        await (await client.submit("warm up", max_tokens=2)).result()
        busy0 = engine_busy_s(port)
        alone = await interactive(client, args, random.Random(args.seed))
        busy1 = engine_busy_s(port)
        # The engine's share of the wall time spent in steps while the interactive load ran alone.
        busy_share = None if busy0 is None else (busy1 - busy0) / (alone["t1"] - alone["t0"])
        print(f"interactive alone: {fmt(alone)}", file=sys.stderr)

        solo = BatchLoad(client, batch_lines(args.batch_lines, args.batch_tokens), args.max_in_flight)
        t0 = time.monotonic()
        await solo.runner.run()
        wall = time.monotonic() - t0
        capacity = sum(n for _, n in solo.finished) / wall
        print(f"batch alone: {len(solo.finished)} lines, {capacity:.1f} output tokens/s", file=sys.stderr)

        mixed = BatchLoad(client, batch_lines(args.batch_lines, args.batch_tokens), args.max_in_flight)
        run = asyncio.create_task(mixed.runner.run())
        while len(mixed.finished) < min(args.max_in_flight, args.batch_lines // 4) and not run.done():
            await asyncio.sleep(0.1)  # the batch is running at full width
        beside = await interactive(client, args, random.Random(args.seed))
        batch_done_first = run.done()
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        print(f"interactive beside the batch: {fmt(beside)}", file=sys.stderr)
    # Over the overlap only: a batch that ends inside the interactive window leaves idle time after.
    end = min(beside["t1"], mixed.finished[-1][0]) if batch_done_first else beside["t1"]
    batch_tps = mixed.tokens_between(beside["t0"], end + 1e-9) / (end - beside["t0"])
    idle = capacity - alone["output_tokens_per_s"]
    idle_by_time = None if busy_share is None else capacity * max(0.0, 1 - busy_share)
    report = {
        "config": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))},
        "interactive_alone": alone, "interactive_beside_batch": beside,
        "batch_alone_output_tokens_per_s": capacity, "batch_beside_output_tokens_per_s": batch_tps,
        "idle_capacity_output_tokens_per_s": idle,
        "ttft_p50_ratio": beside["ttft_p50_s"] / alone["ttft_p50_s"],
        "ttft_p99_ratio": beside["ttft_p99_s"] / alone["ttft_p99_s"],
        "idle_capacity_used": batch_tps / idle if idle > 0 else None,
        # The capacity the interactive load leaves read by engine time: the batch's rate alone
        # times the share of the time the engine stood idle under the interactive load.
        "interactive_engine_busy_share": busy_share,
        "idle_capacity_used_by_engine_time": batch_tps / idle_by_time if idle_by_time else None,
        "batch_outlasted_the_window": not batch_done_first, "targets": TARGETS,
    }
    return report


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def fmt(r: dict) -> str:
    return (f"{r['requests']} requests, TTFT p50 {r['ttft_p50_s'] * 1000:.0f} ms, p99 {r['ttft_p99_s'] * 1000:.0f} ms, "
            f"{r['output_tokens_per_s']:.1f} output tokens/s")


# --background: the scheduler's background limit (worker/engine/scheduler.py, BackgroundLimit) on,
# as configured, or off (every priority sharing each step alike, the scheduler before it).
BACKGROUND_OFF = {"INFERLINE_SCHEDULER__BACKGROUND_PRIORITY": str(2**31 - 1)}


def limit_env(mode: str) -> dict[str, str]:
    """The worker's environment for a --background mode: off, on, on:N, on:N:M, on:N:M:Q."""
    if mode == "off":
        return BACKGROUND_OFF
    names = ("BACKGROUND_MAX_TOKENS", "BACKGROUND_ALONE_MAX_TOKENS", "BACKGROUND_QUIET_S")
    head, *values = mode.split(":")
    if head != "on" or len(values) > len(names):
        raise SystemExit(f"--background: {mode!r} is not off, on, on:N, on:N:M or on:N:M:Q")
    return {f"INFERLINE_SCHEDULER__{name}": str(float(v) if name.endswith("_S") else int(v))
            for name, v in zip(names, values)}


def one_round(args, settings, mode: str) -> dict:
    """A fresh worker with the background limit `mode` (off, on, on:N) and the three loads."""
    topics = e2e.Topics(f"bench-batch-{uuid.uuid4().hex[:8]}")
    proc = None
    try:
        e2e.create_topics(settings, topics)
        port = e2e.free_port()
        log = args.out.parent / f"batch_priority.{mode.replace(':', '-')}.worker.log"
        env = e2e.worker_env(settings, topics, port, args)
        env.update(limit_env(mode))
        proc = e2e.spawn_worker(env, log)
        e2e.wait_ready(proc, port, log, args.ready_timeout)
        print(f"-- background limit {mode}", file=sys.stderr)
        return asyncio.run(run_all(args, settings, topics, port))
    finally:
        if proc is not None:
            e2e.stop_worker(proc)
        e2e.delete_topics(settings, topics)


def main(argv=None) -> dict:
    from inferline.config.settings import load_settings

    args = parse_args(argv)
    settings = load_settings()
    settings = settings.model_copy(update={"scheduler": settings.scheduler.model_copy(update={
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens})})
    leased = e2e.acquire_broker(settings)
    try:
        rounds = {mode: one_round(args, settings, mode) for mode in args.background.split(",")}
    finally:
        if leased:
            e2e.release_broker()
    report = {"cpu": cpu_model(), "rounds": rounds}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for mode, r in rounds.items():
        used = r["idle_capacity_used"]
        print(f"background limit {mode}: TTFT p50 x{r['ttft_p50_ratio']:.2f}, p99 x{r['ttft_p99_ratio']:.2f} "
              f"(target <= x{TARGETS['ttft_p99_ratio_max']}); batch used "
              f"{_pct(used)} of the idle capacity "
              f"(target >= {TARGETS['idle_capacity_used_min']:.0%}); by engine time "
              f"{_pct(r['idle_capacity_used_by_engine_time'])} (the engine busy "
              f"{_pct(r['interactive_engine_busy_share'])} under the interactive load alone)")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
