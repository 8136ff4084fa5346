"""KV block size: one workload at block sizes 8, 16, 32, 64 and 128, on the same KV memory.

    python -m bench.block_size                              # 64 requests, 3-4 min a size
    python -m bench.block_size --quick --block-sizes 8 128  # a tiny run, for the smoke test

For each size, a ModelRunner with `--kv-slots` token slots (num_blocks = slots / size) runs the
same requests (bench/engine.py's run): bench/workload.py's prompts, two in three behind one of two
long system prompts, all at t=0. The slots hold fewer sequences than there are requests, so the
block size decides how many run at once. Prints tokens/s, TTFT, KV waste (slots in use holding no
token: mean, peak, of the whole cache), prefix-cache hits, the batch, preemptions; writes
bench/results/block_size.json. The kernels are the settings' pick (C on a CPU, Triton on a GPU).
"""

from __future__ import annotations

import gc
import statistics
import time

from bench import roofline, stats
from bench.engine import engine_settings, gc_frozen, run_engine, summarize, warm_up_engine
from bench.workload import CONTEXT, WorkItem, add_workload_args, chat_ids, from_args, parse

BLOCK_SIZES = (8, 16, 32, 64, 128)
# Two long system prompts (~190 tokens each): the prefixes that requests share.
SYSTEM_PROMPTS = (
    "You are a patient teacher. " + " ".join(CONTEXT),
    "You are a careful science writer. " + " ".join(reversed(CONTEXT)),
)


def make_items(tokenizer, args) -> list[WorkItem]:
    """The engine benchmark's workload, a shared system prompt on two in three requests."""
    out = []
    for i, item in enumerate(from_args(tokenizer, args)):
        messages = item.messages
        if i % 3:
            messages = [{"role": "system", "content": SYSTEM_PROMPTS[i // 3 % 2]}, *messages]
        ids = chat_ids(tokenizer, messages)
        out.append(WorkItem(item.request_id, messages, ids, item.max_tokens, 0.0))
    return out


def run_at(args, block_size: int, items: list[WorkItem] | None) -> tuple[dict, list[WorkItem]]:
    """A runner at `block_size`, warmed, runs the workload (built from its tokenizer if None)."""
    from inferline.worker.engine.model_runner import ModelRunner

    settings = engine_settings("continuous", args.max_num_seqs, args.max_num_batched_tokens)
    settings.cache.block_size, settings.cache.num_blocks = block_size, args.kv_slots // block_size
    runner = ModelRunner(settings)
    items = items or make_items(runner.tokenizer, args)
    warm_up_engine(runner)
    with gc_frozen():
        rec = run_engine(runner, settings, items, f"block {block_size}")
    used = [s["kv_cache_waste"] for s in rec.steps if s["kv_cache_usage"]] or [0.0]
    of_all = statistics.fmean(s["kv_cache_waste"] * s["kv_cache_usage"] for s in rec.steps)
    waste = {"mean": statistics.fmean(used), "peak": max(used), "of_cache_mean": of_all}
    largest = max(s["num_running"] for s in rec.steps)
    return {**summarize(rec), "largest_batch": largest, "kv_waste": waste}, items


def measure(args) -> dict:
    """Every size `args.repeats` times in ABBA order (the machine's load drifts over minutes).
    Scheduling does not depend on time (all at t=0), so waste, batch and hits repeat exactly;
    tokens/s is the median run's."""
    runs: dict[int, list[dict]] = {b: [] for b in args.block_sizes}
    items = None
    for block_size in stats.abba(args.block_sizes, args.repeats):
        run, items = run_at(args, block_size, items)
        runs[block_size].append(run)
        gc.collect()
    return {
        "kv_slots": args.kv_slots,
        "num_requests": len(items),
        "output_tokens": sum(i.max_tokens for i in items),
        "runs": {
            str(b): stats.median_run(rs, lambda r: r["tokens_per_s"]) for b, rs in runs.items()
        },
    }


def report(res: dict) -> None:
    fmt = stats.fmt
    print(
        f"\n{res['num_requests']} requests at t=0, {res['output_tokens']} output tokens; "
        f"{res['kv_slots']} KV slots at every block size"
    )
    head = (
        f"{'block':>5}{'blocks':>7}{'tok/s':>7}{'TTFT p50':>9}{'p99':>7}{'waste mean':>11}"
        f"{'peak':>6}{'of cache':>9}{'hits':>7}{'largest':>8}{'running':>8}{'preempt':>8}"
    )
    print(head + "\n" + "-" * len(head))
    for bs, r in res["runs"].items():
        w, t = r["kv_waste"], r["ttft_s"]
        print(
            f"{bs:>5}{r['num_blocks']:>7}{fmt(r['tokens_per_s']):>7}{fmt(t['p50']):>8}s"
            f"{fmt(t['p99']):>6}s{fmt(w['mean'], '.1%'):>11}{fmt(w['peak'], '.0%'):>6}"
            f"{fmt(w['of_cache_mean'], '.1%'):>9}{r['prefix_cache_hit_tokens']:>7}"
            f"{r['largest_batch']:>8}{fmt(r['mean_running']):>8}{r['preemptions']:>8}"
        )
    print("  (hits: prompt tokens found in the prefix cache; largest, running: the most sequences")
    print("   running at once, and the mean)")


def parse_args(argv=None):
    p = stats.parser("block_size", __doc__, threads=2, out="block_size.json")
    add_workload_args(p, max_output=200, max_prompt=200)
    p.add_argument("--block-sizes", type=int, nargs="+", default=list(BLOCK_SIZES))
    p.add_argument("--kv-slots", type=int, default=8192, help="token slots at every block size")
    p.add_argument("--repeats", type=int, default=1, help="runs of every size, in ABBA order")
    args = parse(p, argv)
    if args.quick:
        args.kv_slots = min(args.kv_slots, 512)  # one or two requests at a time
    if any(args.kv_slots % b for b in args.block_sizes):
        p.error("--kv-slots must be a multiple of every block size")
    return args


def main(argv=None) -> dict:
    args, started = parse_args(argv), time.time()
    res = stats.header("block_size", argv)
    res.update(roofline.in_thread(lambda: measure(args), args.threads))
    return stats.save(res, args.out, started, report)


if __name__ == "__main__":
    main()
