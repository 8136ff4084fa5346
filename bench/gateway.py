"""The gateway's cost: the same load through the OpenAI gateway and straight onto Kafka, in one command.

    python -m bench.gateway                     # 32 chat requests, outputs in [8, 96], 16 streams, ABBA x2
    python -m bench.gateway --quick             # 4 requests x 8 tokens (a smoke run)
    python -m bench.gateway --clients kafka,sdk # without guidellm

One broker (`scripts/kafka.sh acquire`), one `python -m inferline.worker` and one `python -m
producer.gateway` subprocess on fresh topics; then, back to back, the same requests (bench/workload.py:
chat messages, greedy, ignore_eos, exact output lengths) at the same concurrency:

- kafka:    this process's InferenceClient straight onto the request topic;
- sdk:      the official openai SDK, streaming, through the gateway (the same driver loop as kafka);
- guidellm: guidellm (`guidellm run`, the vLLM project's benchmark client), offline, with these
            prompts as its json_file data and the model's local tokenizer, through the gateway.

Per load: useful tokens/s (output tokens of completed requests / first send to last answer),
TTFT (send to first text) p50/p99, the gateway's own TTFT mean (its histogram, read around the
load) and the CPU seconds of the worker, the gateway, the broker and the client (where the
gateway's cost goes); then each gateway load against kafka, medians over the repeats (targets:
>= 0.9x throughput, <= 20 ms more TTFT p50); and an idle probe, kafka and sdk taking turns with
single requests. Writes bench/results/gateway.json (--out).
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path

from bench import kafka_e2e as e2e
from bench.gateway_loads import KafkaDriver, SdkDriver, Timed, drive, idle_probe, run_guidellm, shorter
from bench.workload import add_workload_args, apply_quick

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "gateway.json"
GUIDELLM_VENV = REPO / ".cache" / "guidellm-venv" / "bin" / "guidellm"
TARGETS = {"throughput_ratio_min": 0.9, "ttft_p50_diff_max_ms": 20.0}
CLIENTS = ("kafka", "sdk", "guidellm")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__.split("\n\n")[0])
    add_workload_args(p)
    p.set_defaults(num_requests=32, max_output=96, max_prompt=200)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (guidellm: streams)")
    p.add_argument("--clients", default=None,
                   help=f"loads to run, in this order (default: {','.join(CLIENTS)}, guidellm where installed)")
    p.add_argument("--repeats", type=int, default=2, help="the loads this often, reversed every other time")
    p.add_argument("--probe", type=int, default=16,
                   help="idle TTFT probe: this many single 2-token requests per path, kafka and sdk taking turns; 0 skips")
    p.add_argument("--guidellm", default=None, help=f"the guidellm command (default: on PATH, else {GUIDELLM_VENV})")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--flush-interval-ms", type=float, default=None, help="the worker's token coalescing")
    # One: on a busy 2-core machine two OpenMP threads stall at every barrier (docs/benchmarks.md).
    p.add_argument("--threads", type=int, default=1, help="the worker's torch threads (0: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    apply_quick(args)
    if args.quick:
        args.repeats, args.probe = 1, min(args.probe, 4)
    if args.clients is None:
        args.clients = [c for c in CLIENTS if c != "guidellm" or find_guidellm(args)]
    else:
        args.clients = [c for c in args.clients.split(",") if c]
    if unknown := set(args.clients) - set(CLIENTS):
        p.error(f"unknown clients {sorted(unknown)}")
    if "guidellm" in args.clients and not find_guidellm(args):
        p.error("guidellm not found: install it (docs/benchmarks.md says how) or leave it out of --clients")
    return args


def find_guidellm(args) -> str | None:
    return args.guidellm or shutil.which("guidellm") or (str(GUIDELLM_VENV) if GUIDELLM_VENV.exists() else None)


# ---- the fleet: worker and gateway subprocesses ----------------------------------------------------


def gateway_env(settings, topics, port: int) -> dict[str, str]:
    env = {k: v for k, v in e2e.worker_env(settings, topics, port, argparse.Namespace(
        flush_interval_ms=None, threads=0)).items() if not k.startswith(("INFERLINE_SCHEDULER", "INFERLINE_HTTP"))}
    env.update({"INFERLINE_GATEWAY__HOST": "127.0.0.1", "INFERLINE_GATEWAY__PORT": str(port),
                "INFERLINE_GATEWAY__API_KEYS": "{}"})
    env.pop("INFERLINE_GATEWAY__API_KEYS_FILE", None)
    return env


def spawn_gateway(env: dict[str, str], log_path: Path):
    import subprocess

    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-P", "-m", "inferline.producer.gateway"], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT)


class Fleet:
    """Broker lease, topics, worker and gateway; stopped and deleted on exit."""

    def __init__(self, args, settings):
        self.args, self.settings = args, settings
        self.topics = e2e.Topics(f"bench-gw-{uuid.uuid4().hex[:8]}")
        self.worker_port, self.gateway_port = e2e.free_port(), e2e.free_port()
        self.procs: dict = {}
        self.leased = False

    def __enter__(self) -> Fleet:
        self.leased = e2e.acquire_broker(self.settings)
        try:
            e2e.create_topics(self.settings, self.topics)
            logs = self.args.out.parent
            logs.mkdir(parents=True, exist_ok=True)
            env = e2e.worker_env(self.settings, self.topics, self.worker_port, self.args)
            self.procs["worker"] = e2e.spawn_worker(env, logs / "gateway.worker.log")
            self.procs["gateway"] = spawn_gateway(gateway_env(self.settings, self.topics, self.gateway_port),
                                                  logs / "gateway.gateway.log")
            for name, port in (("worker", self.worker_port), ("gateway", self.gateway_port)):
                e2e.wait_ready(self.procs[name], port, logs / f"gateway.{name}.log", self.args.ready_timeout)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs.values():
            e2e.stop_worker(proc)  # SIGTERM, then a kill: the same for both
        e2e.delete_topics(self.settings, self.topics)
        if self.leased:
            e2e.release_broker()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}/v1"

    def gateway_ttft(self) -> tuple[float, float]:
        """The gateway's own TTFT histogram (request received -> first text written): sum, count."""
        _, text = e2e.http_get(self.gateway_port, "/metrics")
        name = "inferline_gateway_ttft_seconds"
        values = dict(line.split(" ", 1) for line in text.splitlines() if line.startswith(name + "_"))
        return float(values.get(f"{name}_sum", 0)), float(values.get(f"{name}_count", 0))

    def cpu(self) -> dict[str, float | None]:
        return {"worker": e2e.thread_cpu(self.procs["worker"].pid).get("total"),
                "gateway": e2e.thread_cpu(self.procs["gateway"].pid).get("total"), "broker": e2e.broker_cpu()}


# ---- one load ------------------------------------------------------------------------------------------


def run_load(client: str, fleet: Fleet, items, args, tokenizer_dir: Path) -> dict:
    """One load; the fleet's counters are read after its warm-up and after its last answer."""
    marks = []

    def mark() -> None:
        marks.append((fleet.cpu(), time.process_time(), fleet.gateway_ttft()))

    extra = {}
    if client in ("kafka", "sdk"):
        driver = KafkaDriver(fleet.settings, fleet.topics) if client == "kafka" else SdkDriver(fleet.url)
        timed = asyncio.run(drive(driver, items, args.concurrency, on_start=mark))
    else:
        asyncio.run(drive(SdkDriver(fleet.url), [shorter(i) for i in items[:2]], 2, warm=0))  # the sdk load's warm-up
        mark()
        timed, extra = run_guidellm(find_guidellm(args), fleet.url.removesuffix("/v1"), items, tokenizer_dir,
                                    args.out.parent / "guidellm", args.concurrency, timeout_s=3600)
    mark()
    (c0, p0, g0), (c1, p1, g1) = marks
    cpu = {k: (c1[k] - c0[k]) if c1[k] is not None and c0[k] is not None else None for k in c1}
    return {"client": client, **summarize(timed, len(items)), "cpu_s": {**cpu, "bench_process": p1 - p0, **extra},
            "gateway_ttft_mean_s": mean_between(g0, g1)}


def mean_between(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """The mean of what a histogram (sum, count) observed between two scrapes."""
    count = after[1] - before[1]
    return (after[0] - before[0]) / count if count else None


def summarize(timed: list[Timed], expected: int) -> dict:
    ok = [t for t in timed if t.ok]
    wall = max(t.end for t in timed) - min(t.start for t in timed) if timed else 0.0
    tokens = sum(t.tokens for t in ok)
    return {"requests": len(timed), "completed": len(ok), "complete": len(ok) == expected, "wall_s": wall,
            "useful_tokens": tokens, "tokens_per_s": tokens / wall if wall else 0.0,
            "ttft_s": e2e.dist([t.first - t.start for t in ok if t.first is not None])}


def compare(runs: list[dict]) -> dict:
    """Each gateway load against kafka: medians over repeats, the ratio and the TTFT p50 difference."""
    def med(client, fn):
        vals = [fn(r) for r in runs if r["client"] == client]
        return statistics.median(vals) if vals else None

    out = {}
    base_tps, base_ttft = med("kafka", lambda r: r["tokens_per_s"]), med("kafka", lambda r: r["ttft_s"]["p50"])
    for client in sorted({r["client"] for r in runs} - {"kafka"}):
        tps, ttft = med(client, lambda r: r["tokens_per_s"]), med(client, lambda r: r["ttft_s"]["p50"])
        if base_tps is None or tps is None or base_ttft is None or ttft is None:
            continue
        ratio, diff_ms = tps / base_tps, 1e3 * (ttft - base_ttft)
        out[client] = {"throughput_ratio": ratio, "ttft_p50_diff_ms": diff_ms,
                       "ttft_p99_ratio": med(client, lambda r: r["ttft_s"]["p99"]) / med("kafka", lambda r: r["ttft_s"]["p99"]),
                       "throughput_met": ratio >= TARGETS["throughput_ratio_min"],
                       "ttft_met": diff_ms <= TARGETS["ttft_p50_diff_max_ms"]}
    return out


def probe(fleet: Fleet, items, n: int) -> dict:
    """The idle probe: what the gateway adds to one request's TTFT with no load to hide it."""
    drivers = {"kafka": KafkaDriver(fleet.settings, fleet.topics), "sdk": SdkDriver(fleet.url)}
    g0 = fleet.gateway_ttft()
    ttft = asyncio.run(idle_probe(drivers, items, n))
    g1 = fleet.gateway_ttft()
    pairs = [b - a for a, b in zip(ttft["kafka"], ttft["sdk"])]
    # Where an sdk TTFT goes: inside the gateway (Kafka both ways, the worker) vs the HTTP hops and the SDK.
    return {"kafka_ttft_s": e2e.dist(ttft["kafka"]), "sdk_ttft_s": e2e.dist(ttft["sdk"]),
            "paired_diff_ms": e2e.dist([1e3 * d for d in pairs]), "gateway_ttft_mean_s": mean_between(g0, g1)}


# ---- report and main ------------------------------------------------------------------------------------


def print_report(results: dict) -> None:
    w, s = results["workload"], results["settings"]
    print(f"\nWorkload: {w['num_requests']} chat requests, prompts {w['prompt_tokens']['min']}-{w['prompt_tokens']['max']}"
          f" tokens, outputs {w['output_tokens']['min']}-{w['output_tokens']['max']} (total {w['output_tokens']['total']}),"
          f" greedy, ignore_eos, {s['concurrency']} in flight")
    head = (f"{'load':<12}{'tok/s':>8}{'wall s':>8}{'TTFT p50':>10}{'p99':>9}{'mean':>9}{'in gw':>9}{'done':>6}"
            "   CPU s: worker gateway broker client")
    print("\n" + head + "\n" + "-" * len(head))
    for r in results["runs"]:
        print(row(r))
    if p := results.get("idle_probe"):
        print(f"idle probe ({p['kafka_ttft_s']['n']} single requests each, taking turns): TTFT p50 kafka "
              f"{1e3 * p['kafka_ttft_s']['p50']:.1f} ms, sdk {1e3 * p['sdk_ttft_s']['p50']:.1f} ms; "
              f"sdk - kafka per pair p50 {p['paired_diff_ms']['p50']:+.1f} ms; means: kafka "
              f"{1e3 * p['kafka_ttft_s']['mean']:.1f} ms, inside the gateway {1e3 * (p['gateway_ttft_mean_s'] or 0):.1f} ms,"
              f" sdk {1e3 * p['sdk_ttft_s']['mean']:.1f} ms")
    for client, c in results["comparison"].items():
        print(f"{client} vs kafka: throughput {c['throughput_ratio']:.3f}x (target >= {TARGETS['throughput_ratio_min']})"
              f" {'MET' if c['throughput_met'] else 'not met'}; TTFT p50 {c['ttft_p50_diff_ms']:+.1f} ms (target <= "
              f"{TARGETS['ttft_p50_diff_max_ms']:.0f}) {'MET' if c['ttft_met'] else 'not met'}; TTFT p99 {c['ttft_p99_ratio']:.2f}x")


def row(r: dict) -> str:
    """One load's line: throughput, TTFT (the client's; "in gw": the gateway's own mean), CPU seconds."""
    c, t, gw = r["cpu_s"], r["ttft_s"], r["gateway_ttft_mean_s"]
    client_cpu = c.get("guidellm_cpu_s", c["bench_process"])
    return (f"{r['label']:<12}{r['tokens_per_s']:>8.1f}{r['wall_s']:>8.1f}{1e3 * t['p50']:>8.0f}ms{1e3 * t['p99']:>7.0f}ms"
            f"{1e3 * t['mean']:>7.0f}ms{'-' if gw is None else f'{1e3 * gw:.0f}ms':>9}{r['completed']:>6}   "
            f"{e2e.fmt(c['worker'], '.1f'):>6} {e2e.fmt(c['gateway'], '.1f'):>7} {e2e.fmt(c['broker'], '.1f'):>6}"
            f" {client_cpu:>6.1f}")


def order(args) -> list[tuple[int, str]]:
    runs = []
    for i in range(args.repeats):
        runs += [(i, c) for c in (args.clients if i % 2 == 0 else list(reversed(args.clients)))]
    return runs


def main(argv=None) -> dict:
    args = parse_args(argv)
    from inferline.worker.engine.models.loader import load_tokenizer, resolve_model_dir

    started = time.time()
    settings = e2e.bench_settings(args)
    tokenizer_dir = resolve_model_dir(settings.model.path or None)
    items = e2e.workload(load_tokenizer(tokenizer_dir), args)
    results = {"command": "python -m bench.gateway " + " ".join(argv if argv is not None else sys.argv[1:]),
               "machine": e2e.machine_info(), "targets": TARGETS, "workload": e2e.workload_stats(items),
               "settings": {"concurrency": args.concurrency, "max_num_seqs": args.max_num_seqs,
                            "max_num_batched_tokens": args.max_num_batched_tokens, "clients": args.clients,
                            "repeats": args.repeats, "worker_threads": args.threads}}
    runs = []
    with Fleet(args, settings) as fleet:
        for i, client in order(args):
            print(f"run {i + 1}/{args.repeats}: {client}...", file=sys.stderr)
            runs.append({**run_load(client, fleet, items, args, tokenizer_dir),
                         "label": f"{client}#{i + 1}" if args.repeats > 1 else client})
        if args.probe:
            print("idle probe...", file=sys.stderr)
            results["idle_probe"] = probe(fleet, items, args.probe)
    results.update(runs=runs, comparison=compare(runs))
    return e2e.save(results, args.out, started, print_report)


if __name__ == "__main__":
    main()
