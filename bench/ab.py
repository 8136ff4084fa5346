"""What the A/B benchmarks share (bench/kv_dtype.py, bench/spec_decode.py): the ABBA order on one
workload, their common arguments, and the thread they measure on.

ABBA: A, B, B, A in one process, so a drift in the machine's load (shared, noisy) cancels in the
means. Each run's `summarize` keeps its canary (the machine's matmul rate just before it).
"""
from __future__ import annotations

import argparse
from typing import Callable

from bench import roofline
from bench.engine import RunRecord, summarize


def abba(run_one: Callable[[str], RunRecord], a: str, b: str) -> dict:
    """`run_one(mode)` for a, b, b, a. Returns the summaries per mode, the ratio of the means
    (b / a, tokens/s), and how many requests produced the same tokens under both."""
    runs: dict[str, list] = {a: [], b: []}
    tokens: dict[str, dict] = {}
    for mode in (a, b, b, a):
        record = run_one(mode)
        runs[mode].append(summarize(record))
        tokens.setdefault(mode, record.token_ids)
    same = sum(tokens[a][r] == ids for r, ids in tokens[b].items())
    mean = {m: sum(s["tokens_per_s"] for s in ss) / len(ss) for m, ss in runs.items()}
    return {"runs": runs, "ratio": mean[b] / mean[a], "same_greedy": same, "num_requests": len(tokens[a])}


def in_abba_order(res: dict, a: str, b: str):
    """(mode, summary) of abba's runs in the order they ran."""
    return [(m, res["runs"][m][i]) for m, i in ((a, 0), (b, 0), (b, 1), (a, 1))]


def steps_line(summary: dict) -> str:
    """A run's step counts and mean times by kind, e.g. "decode 245 x 121.4 ms, mixed 21 x 783.6 ms"."""
    return ", ".join(f"{kind} {v['count']} x {v['mean_ms']:.1f} ms" for kind, v in summary["step_time_ms"].items())


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", choices=("continuous", "static"), default="continuous")
    p.add_argument("--seats", type=int, default=0, help="max_num_seqs (default: 64 continuous, 16 static)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)


def parse(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    args = p.parse_args(argv)
    args.seats = args.seats or (64 if args.policy == "continuous" else 16)
    return args


def main(measure: Callable, report: Callable, args: argparse.Namespace) -> dict:
    """Measure on a thread of its own with `args.threads` OpenMP threads (see bench/roofline.py), then report."""
    res = roofline.in_thread(lambda: measure(args), args.threads)
    report(args, res)
    return res
