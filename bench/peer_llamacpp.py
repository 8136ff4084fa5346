"""The peer benchmark: llama.cpp's llama-server on the same GGUF file against inferline through
Kafka, one workload, one command. Started by bench/peer_llamacpp.sh (`make bench-peer`), which
builds llama-server and passes --server-bin:

    bench/peer_llamacpp.sh                            # 48 requests, -np 16, inferline auto/c/onednn
    bench/peer_llamacpp.sh --quick                    # 4 requests x 8 tokens (a smoke run)
    bench/peer_llamacpp.sh --linear auto --repeats 2  # llamacpp, auto, auto, llamacpp (ABBA)

bench/workload.py's prompts as token ids to both, output lengths lognormal (median
--median-output, --sigma, clipped to [8, --max-output]), greedy, ignore_eos, all at t0.
llama-server gets them on streamed /completion (`cache_prompt` false); inferline through the
local broker (bench/kafka_e2e.py), one worker per --linear value (INFERLINE_MODEL__CPU_LINEAR).
Prints tokens/s, TTFT p50/p99, each inferline run's ratio to llama-server's and the backends each
worker chose; writes bench/results/peer_llamacpp.json. llama.cpp multiplies 4-bit weights by
8-bit activations, inferline computes fp32: token counts are checked, not tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import math
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import kafka_e2e as e2e
from bench import stats
from bench.workload import add_workload_args, describe, from_args, line, parse


def parse_args(argv=None):
    p = stats.parser("peer_llamacpp", __doc__, out="peer_llamacpp.json")
    add_workload_args(p, num_requests=48, max_output=384)
    p.add_argument("--server-bin", type=Path, help="llama-server (peer_llamacpp.sh builds it)")
    p.add_argument("--gguf", type=Path, help="the GGUF file for both (default: the model's)")
    p.add_argument("--median-output", type=int, default=96)
    p.add_argument("--sigma", type=float, default=0.6, help="of the log of the output length")
    p.add_argument("--parallel", type=int, default=16, help="llama-server -np (its slots)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server -t")
    linear = "one inferline worker per INFERLINE_MODEL__CPU_LINEAR value"
    p.add_argument("--linear", nargs="+", default=["auto", "c", "onednn"], help=linear)
    p.add_argument("--repeats", type=int, default=1, help="rounds, in ABBA order")
    p.add_argument("--skip-llamacpp", action="store_true", help="inferline only")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    args = parse(p, argv)
    args.median_output = 8 if args.quick else args.median_output
    if not args.skip_llamacpp and args.server_bin is None:
        p.error("--server-bin is needed (bench/peer_llamacpp.sh builds it), or --skip-llamacpp")
    args.min_output = min(8, args.max_output)
    return args


def lognormal_lengths(n: int, median: int, sigma: float, low: int, high: int, seed: int) -> list:
    """n output lengths, lognormal around `median`, rounded and clipped to [low, high]."""
    rng = random.Random(seed)
    return [
        min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)
    ]


def server_ctx(parallel: int, max_prompt_ids: int, max_output: int) -> int:
    """llama-server's -c: split evenly between the slots, each of which must hold a request."""
    return parallel * 256 * math.ceil((max_prompt_ids + max_output + 16) / 256)


def parse_backend_info(metrics_text: str) -> dict[str, dict[str, str]]:
    """`inferline_kernel_backend_info{kind=..,backend=..,how=..} 1.0` -> {kind: {backend, how}}."""
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith("inferline_kernel_backend_info{") and line.rstrip().endswith(" 1.0"):
            labels = dict(
                part.split("=", 1)
                for part in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            labels = {k: v.strip('"') for k, v in labels.items()}
            out[labels["kind"]] = {"backend": labels["backend"], "how": labels["how"]}
    return out


# ---- llama-server ---------------------------------------------------------------------------


def start_server(args, gguf: Path, ctx: int, port: int):
    import subprocess

    log = args.out.with_suffix(".llama-server.log")
    flags = f"--host 127.0.0.1 --port {port} -np {args.parallel} -c {ctx} -t {args.threads}"
    command = [str(args.server_bin), "-m", str(gguf), *flags.split(), "--no-webui"]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    e2e.wait_ready(proc, port, log, time.monotonic() + args.ready_timeout, "/health")
    return proc


def complete(port: int, item, t0: float) -> stats.Timed:
    """One streamed /completion, timed from t0."""
    body = {"prompt": item.prompt_token_ids, "n_predict": item.max_tokens, "ignore_eos": True}
    body = json.dumps(body | {"temperature": 0, "top_k": 1, "cache_prompt": False, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:500]
    first, chunks, predicted = None, 0, None
    for raw in resp:
        line = raw.decode(errors="replace").strip()
        if line.startswith("data: "):
            event = json.loads(line[len("data: ") :])
            first = first or time.perf_counter()
            if event.get("stop"):
                predicted = event.get("tokens_predicted")
                break
            chunks += 1
    conn.close()
    tokens = min(chunks if predicted is None else predicted, item.max_tokens)
    return stats.Timed(t0, first, time.perf_counter(), tokens)


def llamacpp_run(port: int, items: list) -> dict:
    complete(port, e2e.shorter(items[0]), time.perf_counter())
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        timed = list(pool.map(lambda i: complete(port, i, t0), items))
    return {"path": "llamacpp", **stats.summarize(timed, sum(i.max_tokens for i in items))}


# ---- main -----------------------------------------------------------------------------------


def make_items(args) -> list:
    """bench/workload.py's prompts with lognormal output lengths."""
    from inferline.worker.engine.models.loader import load_tokenizer

    work, median = from_args(load_tokenizer(None), args), args.median_output
    lengths = lognormal_lengths(
        len(work), median, args.sigma, args.min_output, args.max_output, args.seed
    )
    return [dataclasses.replace(w, max_tokens=n) for w, n in zip(work, lengths)]


def print_report(res: dict) -> None:
    m, fmt, w = res["machine"], stats.fmt, res["workload"]
    print(f"\nCPU: {m['cpu']} ({m['cpu_count']} cores)")
    for path, backends in res["backends"].items():
        chosen = ", ".join(f"{k} {v['backend']} ({v['how']})" for k, v in backends.items())
        print(f"{path}: {chosen}")
    print(f"workload: {line(w)}")
    print(f"{'path':20} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9}  vs llama.cpp: tok/s  p99")
    for path, row in res["summary"].items():
        vs = row.get("vs_baseline") or {}
        print(
            f"{path:20} {fmt(row['tokens_per_s'], '8.1f')} {fmt(row['ttft_p50_s'], '8.2f')}s "
            f"{fmt(row['ttft_p99_s'], '8.2f')}s  {fmt(vs.get('tokens_per_s'), '17.2f')}x "
            f"{fmt(vs.get('ttft_p99'), '8.2f')}x{'' if row['complete'] else '  INCOMPLETE'}"
        )


def main(argv=None) -> dict:
    args = parse_args(argv)
    from inferline.config.settings import bundled_model_path

    started, gguf, items = time.time(), args.gguf or bundled_model_path(), make_items(args)
    settings = e2e.bench_settings(args)
    res = stats.header("peer_llamacpp", argv, gguf=str(gguf), workload=describe(items))
    res["settings"] = {k: getattr(args, k) for k in ("parallel", "threads", "max_num_seqs")}
    server, runs = None, []
    with e2e.Fleet(settings, args.out.parent) as fleet:
        workers = {
            f"inferline-{linear}": fleet.add(
                f"peer_llamacpp.worker-{linear}", {"INFERLINE_MODEL__CPU_LINEAR": linear}
            )
            for linear in args.linear
        }
        try:
            if not args.skip_llamacpp:
                port = e2e.free_port()
                longest = max(len(i.prompt_token_ids) for i in items)
                ctx = server_ctx(args.parallel, longest, args.max_output)
                server = start_server(args, gguf, ctx, port)
            fleet.wait(args.ready_timeout)
            res["backends"] = {
                path: parse_backend_info(e2e.http_get(w.port, "/metrics")[1])
                for path, w in workers.items()
            }
            paths = ([] if args.skip_llamacpp else ["llamacpp"]) + list(workers)
            for i, path in enumerate(stats.abba(paths, args.repeats)):
                print(f"run {i + 1}: {path}...", file=sys.stderr)
                r = (
                    llamacpp_run(port, items)
                    if path == "llamacpp"
                    else asyncio.run(e2e.kafka_run(settings, workers[path], items))
                )
                runs.append({**{k: v for k, v in r.items() if not k.startswith("_")}, "path": path})
        finally:
            if server is not None:
                e2e.stop(server)
    res.update(runs=runs, summary=stats.compare(runs, "llamacpp"))
    return stats.save(res, args.out, started, print_report)


if __name__ == "__main__":
    main()
