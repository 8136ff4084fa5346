"""Speculative decoding (n-gram drafts) against plain decoding, alternated in one process.

    python -m bench.spec_decode                          # continuous batching, 64 seats
    python -m bench.spec_decode --policy static          # static batching, 16 seats (HF's batch)
    python -m bench.spec_decode --single 8               # also 8 requests one at a time (latency)
    python -m bench.spec_decode --num-tokens 6 --disable-by-batch-size 16

One ModelRunner, loaded and warmed on one thread; the engine benchmark's 64 requests
(bench/workload.py, all at t=0, greedy, ignore_eos) run plain, ngram, ngram, plain (ABBA: a drift
in the machine's load cancels in the means). Prints tokens/s, steps, mean step times, drafts
proposed and accepted per run, the ratio of the means, and how many requests produced the same
greedy tokens both ways (all of them, or the engine has a bug: drafts never change greedy output).
`--single N` then runs the first N requests alone, one after another, both ways (ABBA again):
single-stream decoding, where a step is bound by reading the weights and drafts come almost free.
"""
from __future__ import annotations

import argparse
import gc

from bench import ab
from bench.engine import engine_settings, run_engine, summarize, warm_up_engine
from bench.workload import make_workload

MODES = ("none", "ngram")


def settings_for(args, method: str, seats: int):
    s = engine_settings(args.policy, seats, 512)
    s.speculative.method = method
    s.speculative.num_tokens = args.num_tokens
    s.speculative.prompt_lookup_max, s.speculative.prompt_lookup_min = args.lookup_max, args.lookup_min
    s.speculative.disable_by_batch_size = args.disable_by_batch_size
    return s


def measure(args) -> dict:
    from inferline.worker.engine.model_runner import ModelRunner

    runner = ModelRunner(settings_for(args, "none", args.seats))
    items = make_workload(runner.tokenizer, args.num_requests, max_output=args.max_output,
                          max_prompt=270, seed=args.seed)
    warm_up_engine(runner)
    gc.freeze()  # as the worker's EngineLoop does once its engine is built
    try:
        res = {"batch": ab.abba(lambda method: run_engine(runner, settings_for(args, method, args.seats), items,
                                                          f"{args.policy} {method}", progress=False), *MODES)}
        if args.single:
            res["single"] = single_stream(runner, args, items[:args.single])
    finally:
        gc.unfreeze()
    return res


def single_stream(runner, args, items) -> dict:
    """Each request alone (one seat), summed over the requests: tokens/s of one stream."""
    totals: dict[str, list] = {m: [] for m in MODES}
    for method in ("none", "ngram", "ngram", "none"):
        useful = span = drafts = accepted = 0
        tokens = {}
        for item in items:
            s = summarize(record := run_engine(runner, settings_for(args, method, 1), [item], method, progress=False))
            useful, span = useful + s["useful_tokens"], span + s["span_s"]
            drafts, accepted = drafts + s["spec_draft_tokens"], accepted + s["spec_accepted_tokens"]
            tokens.update(record.token_ids)
        totals[method].append({"tokens_per_s": useful / span, "spec_draft_tokens": drafts,
                               "spec_accepted_tokens": accepted, "token_ids": tokens})
    same = sum(totals["none"][0]["token_ids"][r] == ids for r, ids in totals["ngram"][0]["token_ids"].items())
    for runs in totals.values():
        for r in runs:
            del r["token_ids"]
    mean = {m: sum(r["tokens_per_s"] for r in rs) / len(rs) for m, rs in totals.items()}
    return {"runs": totals, "ratio": mean["ngram"] / mean["none"], "same_greedy": same,
            "num_requests": len(items)}


def acceptance(s: dict) -> str:
    drafts, accepted = s.get("spec_draft_tokens", 0), s.get("spec_accepted_tokens", 0)
    return f"drafts {drafts}, accepted {accepted} ({accepted / drafts:.0%})" if drafts else "no drafts"


def report(args, res: dict) -> None:
    b = res["batch"]
    print(f"{args.policy} batching, {args.seats} seats, {b['num_requests']} requests, ngram drafts "
          f"k={args.num_tokens}, n={args.lookup_min}..{args.lookup_max}"
          f"{f', off from {args.disable_by_batch_size} running' if args.disable_by_batch_size else ''}; ABBA:")
    for method, s in ab.in_abba_order(b, *MODES):
        print(f"  {method:5s}  {s['tokens_per_s']:6.1f} tok/s  {s['num_steps']} steps ({ab.steps_line(s)}); "
              f"{acceptance(s)}; canary {s['canary_gflops']:.0f} GFLOP/s")
    print(f"  ngram / none: {b['ratio']:.3f}x (means); greedy tokens equal for {b['same_greedy']} "
          f"of {b['num_requests']} requests")
    if "single" in res:
        s = res["single"]
        print(f"one request at a time ({s['num_requests']} requests), ABBA:")
        for method, r in ab.in_abba_order(s, *MODES):
            print(f"  {method:5s}  {r['tokens_per_s']:6.1f} tok/s; {acceptance(r)}")
        print(f"  ngram / none: {s['ratio']:.3f}x (means); greedy tokens equal for {s['same_greedy']} "
              f"of {s['num_requests']} requests")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.spec_decode", description=__doc__.split("\n\n")[0])
    ab.add_workload_args(p)
    p.add_argument("--num-tokens", type=int, default=4, help="drafts per sequence and step")
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--disable-by-batch-size", type=int, default=None)
    p.add_argument("--single", type=int, default=0, help="also run this many requests one at a time")
    return ab.parse(p, argv)


def main(argv=None) -> dict:
    return ab.main(measure, report, parse_args(argv))


if __name__ == "__main__":
    main()
