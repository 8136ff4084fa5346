"""The gateway's cost: the same load through the OpenAI gateway and straight onto Kafka.

    python -m bench.gateway            # 32 chat requests, outputs in [8, 96], 16 streams, ABBA x2
    python -m bench.gateway --quick    # 4 requests x 8 tokens (a smoke run)

A worker and the gateway (bench/kafka_e2e.py's Fleet), then, in ABBA order, the same chat
requests at the same concurrency: `kafka`, an InferenceClient straight onto the request topic;
`sdk`, the openai SDK streaming through the gateway. Per load: tokens/s, TTFT (send to first text)
p50/p99; sdk against kafka (targets: >= 0.9x throughput, at most 20 ms more TTFT p50); an idle
probe, kafka and sdk taking turns with single requests. Writes bench/results/gateway.json.
"""

from __future__ import annotations

import asyncio
import sys
import time

from bench import kafka_e2e as e2e
from bench import stats
from bench.workload import add_workload_args, describe, from_args, line, parse

TARGETS = {"throughput_ratio_min": 0.9, "ttft_p50_diff_max_ms": 20.0}
CLIENTS = ("kafka", "sdk")
MODEL = "SmolLM2-135M-Instruct"


def parse_args(argv=None):
    # One thread: on a busy 2-core machine two OpenMP threads stall at every barrier.
    p = stats.parser("gateway", __doc__, threads=1, out="gateway.json")
    add_workload_args(p, num_requests=32, max_output=96, max_prompt=200)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--repeats", type=int, default=2, help="the loads this often, in ABBA order")
    p.add_argument("--probe", type=int, default=16, help="idle TTFT probe: requests per client")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    args = parse(p, argv)
    if args.quick:
        args.repeats, args.probe = 1, min(args.probe, 4)
    return args


class SdkDriver:
    """The requests through the gateway: the openai SDK, streamed, usage in the last chunk."""

    def __init__(self, base_url: str):
        import openai

        self.openai = openai
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=600)

    async def __aenter__(self) -> SdkDriver:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()

    async def one(self, item) -> stats.Timed:
        start, first, tokens, ok = time.monotonic(), None, 0, True
        try:
            opts = {"stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
            opts["extra_body"] = {"ignore_eos": True}
            stream = await self.client.chat.completions.create(
                model=MODEL, messages=item.messages, max_tokens=item.max_tokens, **opts
            )
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.monotonic()
                tokens = chunk.usage.completion_tokens if chunk.usage else tokens
        except self.openai.APIError:
            ok = False
        return stats.Timed(start, first, time.monotonic(), tokens, ok)


async def load(fleet, settings, client: str, items, concurrency: int) -> dict:
    """A warm-up (connections, metadata), then the load."""
    async with driver(fleet, settings, client) as d:
        await e2e.concurrently([e2e.shorter(i) for i in items[:2]], 2, d.one)
        timed = await e2e.concurrently(items, concurrency, d.one)
    return {"client": client, **stats.summarize(timed, sum(i.max_tokens for i in items))}


def driver(fleet, settings, client: str):
    if client == "kafka":
        return e2e.KafkaDriver(settings, fleet.procs["gateway.worker"].topics, by_ids=False)
    return SdkDriver(f"http://127.0.0.1:{fleet.procs['gateway.gateway'].port}/v1")


async def probe(fleet, settings, items, n: int) -> dict:
    """Single 2-token requests, one at a time, kafka and sdk taking turns (ABBA): pairs measured
    moments apart, so a busy machine's drift cancels; what the gateway adds with no load."""
    ttft = {c: [] for c in CLIENTS}
    async with driver(fleet, settings, "kafka") as kafka, driver(fleet, settings, "sdk") as sdk:
        drivers = {"kafka": kafka, "sdk": sdk}
        for i, client in enumerate(stats.abba(list(CLIENTS), n)):
            t = await drivers[client].one(e2e.shorter(items[i // 2 % len(items)]))
            ttft[client].append(t.first - t.start if t.ok and t.first else None)
    pairs = [b - a for a, b in zip(ttft["kafka"], ttft["sdk"]) if a is not None and b is not None]
    out = {f"{c}_ttft_s": stats.dist(t for t in ttft[c] if t is not None) for c in CLIENTS}
    return {**out, "paired_diff_ms": stats.dist(1e3 * d for d in pairs)}


def print_report(res: dict) -> None:
    w, s, fmt = res["workload"], res["settings"], stats.fmt
    print(f"\nworkload: {line(w)}, chat, {s['concurrency']} in flight")
    head = f"{'load':<10}{'tok/s':>8}{'wall s':>8}{'TTFT p50':>10}{'p99':>8}"
    print("\n" + head + "\n" + "-" * len(head))
    for r in res["runs"]:
        t = r["ttft_s"]
        print(
            f"{r['label']:<10}{r['tokens_per_s']:>8.1f}{r['wall_s']:>8.1f}"
            f"{1e3 * t['p50']:>8.0f}ms{1e3 * t['p99']:>6.0f}ms"
        )
    if p := res.get("idle_probe"):
        kp, sp = p["kafka_ttft_s"]["p50"], p["sdk_ttft_s"]["p50"]
        print(
            f"idle probe: TTFT p50 kafka {fmt(kp and 1e3 * kp)} ms, sdk {fmt(sp and 1e3 * sp)}"
            f" ms; sdk - kafka per pair p50 {fmt(p['paired_diff_ms']['p50'], '+.1f')} ms"
        )
    for client, c in res["comparison"].items():
        met = {k: "MET" if c[k] else "not met" for k in ("throughput_met", "ttft_met")}
        print(
            f"{client} vs kafka: throughput {c['throughput_ratio']:.3f}x ({met['throughput_met']});"
            f" TTFT p50 {c['ttft_p50_diff_ms']:+.1f} ms ({met['ttft_met']})"
        )


def main(argv=None) -> dict:
    args = parse_args(argv)
    from inferline.worker.engine.models.loader import load_tokenizer

    started, settings = time.time(), e2e.bench_settings(args)
    items = from_args(load_tokenizer(settings.model.path or None), args)
    res = stats.header("gateway", argv, targets=TARGETS, workload=describe(items))
    res["settings"] = {"concurrency": args.concurrency, "repeats": args.repeats}
    res["settings"]["worker_threads"], runs = args.threads, []
    with e2e.Fleet(settings, args.out.parent) as fleet:
        worker = fleet.add("gateway.worker", {"OMP_NUM_THREADS": str(args.threads)})
        keys = {"INFERLINE_GATEWAY__API_KEYS": "{}", "INFERLINE_GATEWAY__API_KEYS_FILE": None}
        gateway = {"INFERLINE_GATEWAY__HOST": "127.0.0.1", **keys}
        fleet.add("gateway.gateway", gateway, worker.topics, "inferline.producer.gateway")
        fleet.wait(args.ready_timeout)
        for i, client in enumerate(stats.abba(list(CLIENTS), args.repeats)):
            print(f"run {i + 1}: {client}...", file=sys.stderr)
            r = asyncio.run(load(fleet, settings, client, items, args.concurrency))
            runs.append({**r, "label": f"{client}#{i // 2 + 1}"})
        if args.probe:
            res["idle_probe"] = asyncio.run(probe(fleet, settings, items, args.probe))
    table = stats.compare(runs, "kafka", key="client")
    res.update(
        runs=runs,
        comparison={
            client: {
                "throughput_ratio": vs["tokens_per_s"],
                "ttft_p50_diff_ms": vs["ttft_p50_diff_ms"],
                "ttft_p99_ratio": vs["ttft_p99"],
                "throughput_met": vs["tokens_per_s"] >= TARGETS["throughput_ratio_min"],
                "ttft_met": vs["ttft_p50_diff_ms"] <= TARGETS["ttft_p50_diff_max_ms"],
            }
            for client, row in table.items()
            if (vs := row.get("vs_baseline"))
        },
    )
    return stats.save(res, args.out, started, print_report)


if __name__ == "__main__":
    main()
