"""The engine benchmark's workload on an fp32 and an fp16 K/V cache, alternated in one process.

    python -m bench.kv_dtype                         # continuous batching, 64 seats
    python -m bench.kv_dtype --policy static         # static batching, 16 seats (HF's batch)

Two ModelRunners (INFERLINE_CACHE__DTYPE auto and float16) are loaded and warmed on one thread,
then the same 64 requests (bench/workload.py, all at t=0, greedy, ignore_eos) run fp32, fp16,
fp16, fp32 (ABBA: a drift in the machine's load cancels in the means). Prints tokens/s, decode and
mixed step times per run, the fp16/fp32 ratio of the means, and how many requests produced the
same greedy tokens on both caches (fp16 rounds K/V, so equality is counted, not assumed).
"""
from __future__ import annotations

import argparse
import gc

from bench import ab
from bench.engine import engine_settings, run_engine, warm_up_engine
from bench.workload import make_workload


def measure(args) -> dict:
    from inferline.worker.engine.model_runner import ModelRunner

    settings = {dtype: engine_settings(args.policy, args.seats, 512, True, dtype) for dtype in ("auto", "float16")}
    runners = {dtype: ModelRunner(s) for dtype, s in settings.items()}
    items = make_workload(runners["auto"].tokenizer, args.num_requests, max_output=args.max_output,
                          max_prompt=270, seed=args.seed)
    for runner in runners.values():
        warm_up_engine(runner)
    gc.freeze()  # as the worker's EngineLoop does once its engine is built
    try:
        res = ab.abba(lambda dtype: run_engine(runners[dtype], settings[dtype], items, dtype, progress=False),
                      "auto", "float16")
    finally:
        gc.unfreeze()
    res["fp16_over_fp32"] = res.pop("ratio")
    return res


def report(args, res: dict) -> None:
    print(f"{args.policy} batching, {args.seats} seats, {res['num_requests']} requests, ABBA:")
    for dtype, s in ab.in_abba_order(res, "auto", "float16"):
        print(f"  {'fp32' if dtype == 'auto' else 'fp16'} K/V  {s['tokens_per_s']:6.1f} tok/s  ({ab.steps_line(s)}; "
              f"canary {s['canary_gflops']:.0f} GFLOP/s)")
    print(f"  fp16 / fp32: {res['fp16_over_fp32']:.3f}x (means); greedy tokens equal for {res['same_greedy']} "
          f"of {res['num_requests']} requests")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kv_dtype", description=__doc__.split("\n\n")[0])
    ab.add_workload_args(p)
    return ab.parse(p, argv)


def main(argv=None) -> dict:
    return ab.main(measure, report, parse_args(argv))


if __name__ == "__main__":
    main()
