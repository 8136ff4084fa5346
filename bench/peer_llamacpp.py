"""The peer benchmark (issue #30): llama.cpp's llama-server on the same GGUF file against inferline
through Kafka, one workload, one command. Started by bench/peer_llamacpp.sh (`make bench-peer`),
which builds llama-server and passes --server-bin:

    bench/peer_llamacpp.sh                              # 48 requests, llama-server -np 16, inferline auto/c/onednn
    bench/peer_llamacpp.sh --quick                      # 4 requests x 8 tokens (a smoke run)
    bench/peer_llamacpp.sh --linear auto --repeats 2    # only `auto`; llamacpp, auto, auto, llamacpp (ABBA)

The workload: chat requests (bench/workload.py's prompts, the chat template applied, sent as token
ids to both), output lengths lognormal (median --median-output, --sigma, clipped to [8,
--max-output]), greedy, ignore_eos, all submitted at t0. llama-server gets them on /completion
(`n_predict`, `ignore_eos`, `temperature` 0, `cache_prompt` false, streamed: TTFT is the first
streamed token); inferline through the local broker (bench/kafka_e2e.py: a `python -m inferline.worker`
per --linear value, INFERLINE_MODEL__CPU_LINEAR set to it, its own topics and group).
Useful tokens/s = the output tokens asked for and received / wall time (first submit to last
token). Prints tokens/s, TTFT p50/p99 and each inferline run's ratio to llama-server's, the CPU
model and the backends every worker chose (its /metrics `inferline_kernel_backend_info`);
writes bench/results/peer_llamacpp.json (--out). The two do not compute the same arithmetic
(llama.cpp multiplies the 4-bit weights by 8-bit activations; inferline in fp32), so tokens
differ after a while: the token counts are checked, not the tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import math
import os
import random
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench import kafka_e2e as e2e

RESULTS = e2e.REPO / "bench" / "results" / "peer_llamacpp.json"
LINEAR_CHOICES = ("auto", "c", "onednn", "torch")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.peer_llamacpp", description=__doc__.split("\n\n")[0])
    p.add_argument("--server-bin", type=Path, default=None, help="llama-server (bench/peer_llamacpp.sh builds it)")
    p.add_argument("--gguf", type=Path, default=None, help="the GGUF file for both (default: the default model's)")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--median-output", type=int, default=96)
    p.add_argument("--sigma", type=float, default=0.6, help="of the log of the output length")
    p.add_argument("--max-output", type=int, default=384)
    p.add_argument("--max-prompt", type=int, default=270, help="user message tokens (the chat template adds ~31)")
    p.add_argument("--parallel", type=int, default=16, help="llama-server -np (its slots: concurrent sequences)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server -t")
    p.add_argument("--linear", nargs="+", default=["auto", "c", "onednn"], choices=LINEAR_CHOICES,
                   help="one inferline worker per INFERLINE_MODEL__CPU_LINEAR value")
    p.add_argument("--repeats", type=int, default=1, help="rounds; every other round in reverse order (ABBA)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--flush-interval-ms", type=float, default=None)
    p.add_argument("--skip-llamacpp", action="store_true", help="inferline only (no --server-bin needed)")
    p.add_argument("--quick", action="store_true", help="4 requests x 8 tokens, short prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.median_output, args.max_output, args.max_prompt = min(args.num_requests, 4), 8, 8, 40
    if not args.skip_llamacpp and args.server_bin is None:
        p.error("--server-bin is needed (bench/peer_llamacpp.sh builds llama-server), or --skip-llamacpp")
    args.min_output = min(8, args.max_output)
    return args


# ---- the workload and the report's maths (pure) -------------------------------------------------------


def lognormal_lengths(n: int, median: int, sigma: float, low: int, high: int, seed: int) -> list[int]:
    """n output lengths, lognormal around `median`, rounded and clipped to [low, high]."""
    rng = random.Random(seed)
    return [min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def schedule(paths: list[str], repeats: int) -> list[str]:
    """The run order: every other round reversed (ABBA), so a drifting load hits both alike."""
    return [p for r in range(repeats) for p in (paths if r % 2 == 0 else paths[::-1])]


def server_ctx(parallel: int, max_prompt_ids: int, max_output: int) -> int:
    """llama-server's -c: its context is split evenly between the slots; each must hold a request."""
    per_slot = 256 * math.ceil((max_prompt_ids + max_output + 16) / 256)
    return parallel * per_slot


def percentile(values: list[float], q: float) -> float | None:
    from inferline.producer.cli import percentile as p

    return p(values, q)


def run_stats(ttfts: list[float], useful: int, wall_s: float) -> dict:
    return {"tokens_per_s": useful / wall_s if wall_s > 0 else None, "useful_tokens": useful, "wall_s": wall_s,
            "ttft_s": {"p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99), "n": len(ttfts)}}


def summarize(runs: list[dict]) -> dict:
    """Per path: the median over its runs of tokens/s and TTFT p50/p99; each inferline path's ratios
    to llama.cpp's (tokens/s: higher is better; TTFT: lower is better)."""
    import statistics

    by_path: dict[str, list[dict]] = {}
    for r in runs:
        by_path.setdefault(r["path"], []).append(r)

    def med(rs, get):
        values = [v for v in map(get, rs) if v is not None]
        return statistics.median(values) if values else None

    table = {path: {"tokens_per_s": med(rs, lambda r: r["tokens_per_s"]),
                    "ttft_p50_s": med(rs, lambda r: r["ttft_s"]["p50"]),
                    "ttft_p99_s": med(rs, lambda r: r["ttft_s"]["p99"]), "runs": len(rs),
                    "complete": all(r["complete"] for r in rs)} for path, rs in by_path.items()}
    peer = table.get("llamacpp")
    for path, row in table.items():
        if peer and path != "llamacpp":
            row["vs_llamacpp"] = {"tokens_per_s": _ratio(row["tokens_per_s"], peer["tokens_per_s"]),
                                  "ttft_p50": _ratio(row["ttft_p50_s"], peer["ttft_p50_s"]),
                                  "ttft_p99": _ratio(row["ttft_p99_s"], peer["ttft_p99_s"])}
    return table


def _ratio(a, b):
    return a / b if a is not None and b else None


def parse_backend_info(metrics_text: str) -> dict[str, dict[str, str]]:
    """inferline_kernel_backend_info{kind=..,backend=..,how=..} 1.0 lines -> {kind: {backend, how}}."""
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith("inferline_kernel_backend_info{") and line.rstrip().endswith(" 1.0"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
            labels = {k: v.strip('"') for k, v in labels.items()}
            out[labels["kind"]] = {"backend": labels["backend"], "how": labels["how"]}
    return out


def cpu_info() -> dict:
    from inferline.worker.engine.models.calibration import cpu_model
    from inferline.kernels.cpu.build import cpu_flags

    have = cpu_flags().split()
    return {"model": cpu_model(), "cores": os.cpu_count(),
            "simd": [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in have]}


# ---- llama-server ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int


def start_server(args, gguf: Path, ctx: int, port: int, log_path: Path) -> subprocess.Popen:
    command = [str(args.server_bin), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(args.parallel), "-c", str(ctx), "-t", str(args.threads), "--no-webui"]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    start = time.monotonic()
    while e2e.http_get(port, "/health")[0] != 200:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited {proc.returncode}:\n{log_path.read_text(errors='replace')[-3000:]}")
        if time.monotonic() - start > args.ready_timeout:
            raise TimeoutError("llama-server not ready")
        time.sleep(0.2)
    return proc


def complete(port: int, item: Item, t0: float) -> dict:
    """One streamed /completion: (ttft, tokens received, end time)."""
    body = json.dumps({"prompt": item.prompt_token_ids, "n_predict": item.max_tokens, "ignore_eos": True,
                       "temperature": 0.0, "top_k": 1, "cache_prompt": False, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:500]
    ttft, chunks, predicted = None, 0, None
    for raw in resp:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data: "):
            continue
        event = json.loads(line[len("data: "):])
        if ttft is None:
            ttft = time.perf_counter() - t0
        if event.get("stop"):
            predicted = event.get("tokens_predicted")
            break
        chunks += 1
    conn.close()
    return {"ttft_s": ttft, "tokens": predicted if predicted is not None else chunks, "end": time.perf_counter()}


def llamacpp_run(port: int, items: list[Item]) -> dict:
    warm = Item("warm", items[0].prompt_token_ids, 2)
    complete(port, warm, time.perf_counter())
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        done = list(pool.map(lambda i: complete(port, i, t0), items))
    wall = max(d["end"] for d in done) - t0
    useful = sum(min(d["tokens"], i.max_tokens) for d, i in zip(done, items))
    stats = run_stats([d["ttft_s"] for d in done if d["ttft_s"] is not None], useful, wall)
    return {"path": "llamacpp", **stats, "complete": all(d["tokens"] == i.max_tokens for d, i in zip(done, items))}


# ---- inferline through Kafka ---------------------------------------------------------------------------


class Worker:
    """One `python -m inferline.worker` with INFERLINE_MODEL__CPU_LINEAR=linear on its own topics."""

    def __init__(self, settings, linear: str, args, log_dir: Path):
        self.linear, self.settings = linear, settings
        self.topics = e2e.Topics(f"bench-peer-{linear}-{uuid.uuid4().hex[:8]}")
        e2e.create_topics(settings, self.topics)
        self.port = e2e.free_port()
        env = e2e.worker_env(settings, self.topics, self.port, SimpleArgs(args.flush_interval_ms, 0))
        env["INFERLINE_MODEL__CPU_LINEAR"] = linear
        self.log_path = log_dir / f"peer_llamacpp.worker-{linear}.log"
        self.proc = e2e.spawn_worker(env, self.log_path)

    def wait(self, timeout: float) -> None:
        e2e.wait_ready(self.proc, self.port, self.log_path, timeout)
        self.backends = parse_backend_info(e2e.http_get(self.port, "/metrics")[1])

    def run(self, items: list[Item], tag: str) -> dict:
        r = asyncio.run(e2e.kafka_run(self.settings, self.topics, items, [], tag, False, self.proc.pid, self.port))
        return {"path": f"inferline-{self.linear}", **run_stats([], r["useful_tokens"], r["wall_s"]),
                "ttft_s": r["ttft_s"], "complete": r["complete"], "engine": r["engine"]}

    def stop(self) -> None:
        e2e.stop_worker(self.proc)
        e2e.delete_topics(self.settings, self.topics)


@dataclass(frozen=True)
class SimpleArgs:  # what kafka_e2e.worker_env reads of its arguments
    flush_interval_ms: float | None
    threads: int


# ---- main ----------------------------------------------------------------------------------------------


def make_items(args) -> list[Item]:
    from bench.workload import make_workload
    from inferline.worker.engine.models.loader import load_tokenizer

    tokenizer = load_tokenizer(None)
    work = make_workload(tokenizer, num_requests=args.num_requests, max_output=args.max_output,
                         max_prompt=args.max_prompt, seed=args.seed)
    lengths = lognormal_lengths(len(work), args.median_output, args.sigma, args.min_output, args.max_output, args.seed)
    return [Item(w.request_id, w.prompt_token_ids, n) for w, n in zip(work, lengths)]


def print_report(results: dict) -> None:
    cpu = results["cpu"]
    print(f"\nCPU: {cpu['model']} ({cpu['cores']} cores; {' '.join(cpu['simd'])})")
    for linear, backends in results["backends"].items():
        chosen = ", ".join(f"{k} {v['backend']} ({v['how']})" for k, v in backends.items())
        print(f"inferline CPU_LINEAR={linear}: {chosen}")
    w = results["workload"]
    print(f"workload: {w['num_requests']} requests, outputs {w['output_tokens']['min']}-{w['output_tokens']['max']} "
          f"(total {w['output_tokens']['total']}), prompts {w['prompt_tokens']['min']}-{w['prompt_tokens']['max']} tokens")
    print(f"{'path':20} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9}  vs llama.cpp: tok/s  TTFT p50")
    for path, row in results["summary"].items():
        vs = row.get("vs_llamacpp") or {}
        print(f"{path:20} {e2e.fmt(row['tokens_per_s'], '8.1f')} {e2e.fmt(row['ttft_p50_s'], '8.2f')}s "
              f"{e2e.fmt(row['ttft_p99_s'], '8.2f')}s  {e2e.fmt(vs.get('tokens_per_s'), '17.2f')}x "
              f"{e2e.fmt(vs.get('ttft_p50'), '8.2f')}x{'' if row['complete'] else '  INCOMPLETE'}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    from bench.workload import make_workload  # noqa: F401 (fail early on a broken install)
    from inferline.config.settings import bundled_model_path

    started = time.time()
    gguf = args.gguf or bundled_model_path()
    items = make_items(args)
    settings = e2e.bench_settings(args)
    results = {"command": "bench/peer_llamacpp.sh " + " ".join(argv if argv is not None else sys.argv[1:]),
               "cpu": cpu_info(), "machine": e2e.machine_info(), "gguf": str(gguf),
               "workload": e2e.workload_stats(items), "settings": {
                   "llamacpp": {"parallel": args.parallel, "threads": args.threads, "server_bin": str(args.server_bin)},
                   "inferline": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}}}
    leased = e2e.acquire_broker(settings)
    workers, server = [], None
    try:
        workers = [Worker(settings, linear, args, args.out.parent) for linear in args.linear]
        paths = [] if args.skip_llamacpp else ["llamacpp"]
        if not args.skip_llamacpp:
            port = e2e.free_port()
            ctx = server_ctx(args.parallel, max(len(i.prompt_token_ids) for i in items), args.max_output)
            server = start_server(args, gguf, ctx, port, args.out.with_suffix(".llama-server.log"))
        for w in workers:
            w.wait(args.ready_timeout)
        results["backends"] = {w.linear: w.backends for w in workers}
        paths += [f"inferline-{w.linear}" for w in workers]
        by_path = {f"inferline-{w.linear}": w for w in workers}
        runs = []
        for i, path in enumerate(schedule(paths, args.repeats)):
            print(f"run {i + 1}: {path}...", file=sys.stderr)
            r = llamacpp_run(port, items) if path == "llamacpp" else by_path[path].run(items, f"r{i}")
            r["loadavg_after"] = os.getloadavg()
            runs.append(r)
        results["runs"] = runs
        results["summary"] = summarize(runs)
    finally:
        for w in workers:
            w.stop()
        if server is not None:
            server.terminate()
            server.wait(30)
        if leased:
            e2e.release_broker()
    return e2e.save(results, args.out, started, print_report)


if __name__ == "__main__":
    main()
