"""A/B runs of the engine benchmark's workload in one process, in ABBA order (A, B, B, A: a drift
in the machine's load cancels in the means).

    python -m bench.ab kv-dtype                     # fp32 against fp16 K/V cache, 64 seats
    python -m bench.ab spec-decode                  # plain decoding against n-gram drafts
    python -m bench.ab spec-decode --seats 1 --num-requests 8   # one stream, where drafts pay
    python -m bench.ab kv-dtype --policy static     # static batching, 16 seats (HF's batch)

kv-dtype: two ModelRunners, INFERLINE_CACHE__DTYPE auto and float16; fp16 rounds K/V, so requests
with equal greedy tokens are counted, not assumed. spec-decode: one runner, speculative method
none and ngram; drafts never change greedy tokens, so every request must agree. Prints tokens/s,
step counts and times, drafts accepted, the B/A ratio of the means, the requests that agree.
"""

from __future__ import annotations

from bench import roofline, stats
from bench.engine import engine_settings, gc_frozen, run_engine, summarize, warm_up_engine
from bench.workload import make_workload

EXPERIMENTS = {"kv-dtype": ("auto", "float16"), "spec-decode": ("none", "ngram")}


def settings_for(args, mode: str):
    kv = mode if args.experiment == "kv-dtype" else "auto"
    s = engine_settings(args.policy, args.seats, 512, True, kv)
    if args.experiment == "spec-decode":
        spec = s.speculative
        spec.method, spec.num_tokens, spec.prompt_lookup_min = (
            mode,
            args.num_tokens,
            args.lookup_min,
        )
    return s


def measure(args) -> dict:
    from inferline.worker.engine.model_runner import ModelRunner

    a, b = EXPERIMENTS[args.experiment]
    settings = {m: settings_for(args, m) for m in (a, b)}
    runners = {a: ModelRunner(settings[a])}
    runners[b] = ModelRunner(settings[b]) if args.experiment == "kv-dtype" else runners[a]
    tokenizer = runners[a].tokenizer
    items = make_workload(tokenizer, args.num_requests, max_output=args.max_output, seed=args.seed)
    for runner in {id(r): r for r in runners.values()}.values():
        warm_up_engine(runner)
    runs, tokens = {a: [], b: []}, {}
    with gc_frozen():
        for mode in stats.abba([a, b], 2):
            record = run_engine(runners[mode], settings[mode], items, mode)
            runs[mode].append(summarize(record))
            tokens.setdefault(mode, record.token_ids)
    mean = {m: sum(s["tokens_per_s"] for s in ss) / len(ss) for m, ss in runs.items()}
    return {
        "experiment": args.experiment,
        "runs": runs,
        "ratio": mean[b] / mean[a],
        "same_greedy": sum(tokens[a][r] == ids for r, ids in tokens[b].items()),
        "num_requests": len(items),
    }


def report(args, res: dict) -> None:
    a, b = EXPERIMENTS[args.experiment]
    seats, n = args.seats, res["num_requests"]
    print(f"{args.experiment}: {args.policy} batching, {seats} seats, {n} requests, ABBA:")
    for mode, i in ((a, 0), (b, 0), (b, 1), (a, 1)):
        s = res["runs"][mode][i]
        steps = [f"{k} {v['count']} x {v['mean_ms']:.1f} ms" for k, v in s["step_time_ms"].items()]
        drafts = s["spec_draft_tokens"]
        accepted = f"; drafts {drafts}, accepted {s['spec_accepted_tokens']}" if drafts else ""
        canary = f"canary {s['canary_gflops']:.0f} GFLOP/s"
        print(
            f"  {mode:8s} {s['tokens_per_s']:6.1f} tok/s ({', '.join(steps)}{accepted}; {canary})"
        )
    same = f"greedy tokens equal for {res['same_greedy']} of {n} requests"
    print(f"  {b} / {a}: {res['ratio']:.3f}x (means); {same}")


def parse_args(argv=None):
    p = stats.parser("ab", __doc__, threads=2)
    p.add_argument("experiment", choices=sorted(EXPERIMENTS))
    p.add_argument("--policy", choices=("continuous", "static"), default="continuous")
    p.add_argument("--seats", type=int, default=0, help="max_num_seqs (default: 64, static 16)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-tokens", type=int, default=4, help="spec-decode: drafts per step")
    p.add_argument("--lookup-min", type=int, default=2, help="spec-decode: the shortest n-gram")
    args = p.parse_args(argv)
    args.seats = args.seats or (64 if args.policy == "continuous" else 16)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    res = roofline.in_thread(lambda: measure(args), args.threads)
    report(args, res)
    return res


if __name__ == "__main__":
    main()
