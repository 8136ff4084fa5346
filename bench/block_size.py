"""KV block size: one workload at block sizes 8, 16, 32, 64 and 128, on the same KV memory.

    python -m bench.block_size                              # the full run (64 requests, 3-4 min a pass)
    python -m bench.block_size --quick --block-sizes 8 128  # a tiny run, for the smoke test

For each size, a ModelRunner with INFERLINE_CACHE__BLOCK_SIZE set and `--kv-slots` token slots
(num_blocks = slots / size: the same memory at every size), loaded and warmed on one thread, runs
the same requests through a continuous engine: bench/workload.py's chat prompts, two in three of
them behind one of two long system prompts (shared prefixes), outputs of varied length, greedy,
ignore_eos, all arriving at t=0. The slots hold fewer sequences than there are requests, so the
block size decides how many run at once (unless `--max-num-seqs` caps them first). Prints tokens/s (also per CPU-second), TTFT p50/p99, KV waste (mean over steps and
peak: of the slots in use, and of the whole cache), prefix-cache hit tokens, the largest and mean
running batch, preemptions and steps; writes bench/results/block_size.json and block_size.png.
The kernels are whatever the settings pick: the C kernels on a CPU, Triton on a GPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench import roofline
from bench.engine import (RunRecord, engine_request, engine_settings, fmt, machine_info, median_run, summarize,
                          warm_up_engine)
from bench.workload import CONTEXT, WorkItem, add_workload_args, apply_quick, chat_ids, make_workload

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BLOCK_SIZES = (8, 16, 32, 64, 128)
# Two long system prompts (~190 tokens each): the prefixes that requests share.
SYSTEM_PROMPTS = ("You are a patient teacher. " + " ".join(CONTEXT),
                  "You are a careful science writer. " + " ".join(reversed(CONTEXT)))


def make_items(tokenizer, args) -> list[WorkItem]:
    """The engine benchmark's workload, with a shared system prompt on two in three requests."""
    items = make_workload(tokenizer, args.num_requests, max_output=args.max_output, max_prompt=args.max_prompt,
                          seed=args.seed)
    out = []
    for i, item in enumerate(items):
        messages = item.messages
        if i % 3:
            messages = [{"role": "system", "content": SYSTEM_PROMPTS[i // 3 % 2]}, *messages]
        out.append(WorkItem(item.request_id, messages, chat_ids(tokenizer, messages), item.max_tokens, 0.0))
    return out


def settings_for(args, block_size: int):
    s = engine_settings("continuous", args.max_num_seqs, args.max_num_batched_tokens)
    s.cache.block_size = block_size
    s.cache.num_blocks = args.kv_slots // block_size
    return s


def run(runner, settings, items: list[WorkItem]) -> RunRecord:
    """All of `items` at t=0, stepped until done; per step, the batch and the KV cache's state."""
    from inferline.worker.engine.engine import LLMEngine

    eng = LLMEngine(runner, settings)
    rec = RunRecord(f"block{runner.block_size}", {i.request_id: 0.0 for i in items},
                    {i.request_id: i.max_tokens for i in items}, canary_gflops=roofline.canary_gflops())
    t0, wall0, cpu0 = time.perf_counter(), time.time(), time.process_time()
    for item in items:
        eng.add_request(engine_request(item, wall0))
    while eng.has_unfinished_requests():
        for out in eng.step():
            rec.add_tokens(out.request_id, out.new_token_ids, time.perf_counter() - t0)
            if out.finished and out.finish_reason != "length":
                raise RuntimeError(f"{out.request_id} finished with {out.finish_reason}: {out.error_message}")
        st = eng.stats()
        rec.steps.append({"t": time.perf_counter() - t0, "step_s": st.step_time_s, "batch_size": st.batch_size,
                          "num_running": st.num_running, "num_tokens": st.num_batched_tokens,
                          "kv_usage": st.kv_cache_usage, "kv_waste": st.kv_cache_waste,
                          "preemptions": st.num_preemptions,
                          "kind": "decode" if st.num_batched_tokens == st.batch_size else "mixed"})
    rec.wall_s, rec.cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    st = eng.stats()
    rec.extra = {"block_size": runner.block_size, "num_blocks": eng.block_manager.num_blocks,
                 "prefix_cache_hit_tokens": st.prefix_cache_hits, "prefix_cache_query_tokens": st.prefix_cache_queries}
    return rec


def waste_figures(steps: list[dict]) -> dict:
    """Waste of the slots in use (mean over steps, peak) and of the whole cache (waste x usage)."""
    of_used = [s["kv_waste"] for s in steps if s["kv_usage"]]
    of_all = [s["kv_waste"] * s["kv_usage"] for s in steps]
    return {"mean": statistics.fmean(of_used) if of_used else 0.0, "peak": max(of_used, default=0.0),
            "of_cache_mean": statistics.fmean(of_all) if of_all else 0.0, "of_cache_peak": max(of_all, default=0.0)}


def summary(rec: RunRecord) -> dict:
    out = summarize(rec)
    out["kv_waste"] = waste_figures(rec.steps)
    out["largest_batch"] = max((s["num_running"] for s in rec.steps), default=0)
    stride = max(1, len(rec.steps) // 200)
    out["waste_curve"] = [[round(s["t"], 3), round(s["kv_waste"], 4)] for s in rec.steps[::stride]]
    del out["completion_curve"]
    return out


def run_at(args, block_size: int, items: list[WorkItem] | None) -> tuple[RunRecord, list[WorkItem]]:
    """Load a runner at `block_size`, warm it, run the workload (built from its tokenizer if None)."""
    from inferline.worker.engine.model_runner import ModelRunner

    settings = settings_for(args, block_size)
    runner = ModelRunner(settings)
    items = items or make_items(runner.tokenizer, args)
    warm_up_engine(runner)
    gc.freeze()  # as the worker's EngineLoop does once its engine is built
    try:
        rec = run(runner, settings, items)
    finally:
        gc.unfreeze()
    print(f"block size {block_size}: {rec.wall_s:.0f} s", file=sys.stderr)
    return rec, items


def measure(args) -> dict:
    """Every size `args.repeats` times, the order reversed on every other pass (8 ... 128, 128 ... 8):
    the machine's load drifts over minutes. Scheduling does not depend on time (all requests arrive
    at t=0), so waste, batch and hits repeat exactly; tokens/s is the median run's, all are kept."""
    records: dict[int, list[RunRecord]] = {b: [] for b in args.block_sizes}
    items = None
    for i in range(args.repeats):
        for block_size in args.block_sizes if i % 2 == 0 else args.block_sizes[::-1]:
            rec, items = run_at(args, block_size, items)
            records[block_size].append(rec)
            gc.collect()
    runs = {}
    for block_size, recs in records.items():
        runs[str(block_size)] = summary(median_run(recs))
        runs[str(block_size)]["tokens_per_s_runs"] = [summarize(r)["tokens_per_s"] for r in recs]
    prompts = [len(i.prompt_token_ids) for i in items]
    return {"workload": {"num_requests": len(items), "prompt_tokens": [min(prompts), max(prompts), sum(prompts)],
                         "output_tokens": sum(i.max_tokens for i in items),
                         "shared_system_prompt": sum(len(i.messages) > 1 for i in items)},
            "kv_slots": args.kv_slots, "repeats": args.repeats, "runs": runs}


def report(res: dict) -> None:
    w = res["workload"]
    print(f"{w['num_requests']} requests at t=0 ({w['shared_system_prompt']} behind a shared system prompt), "
          f"prompts {w['prompt_tokens'][0]}-{w['prompt_tokens'][1]} tokens ({w['prompt_tokens'][2]} in all), "
          f"{w['output_tokens']} output tokens; {res['kv_slots']} KV slots at every block size")
    head = (f"{'block':>5}{'blocks':>7}{'tok/s':>7}{'tok/cpu-s':>10}{'TTFT p50':>9}{'p99':>7}{'waste mean':>11}"
            f"{'peak':>6}{'of cache':>9}{'hits':>7}{'rate':>5}{'largest':>8}{'running':>8}{'preempt':>8}{'steps':>6}"
            f"{'canary':>7}")
    print(head)
    print("-" * len(head))
    for bs, r in res["runs"].items():
        wst = r["kv_waste"]
        print(f"{bs:>5}{r['num_blocks']:>7}{fmt(r['tokens_per_s']):>7}{fmt(r['tokens_per_cpu_s']):>10}"
              f"{fmt(r['ttft_s']['p50'], '.1f'):>8}s{fmt(r['ttft_s']['p99'], '.1f'):>6}s"
              f"{fmt(wst['mean'], '.1%'):>11}{fmt(wst['peak'], '.0%'):>6}{fmt(wst['of_cache_mean'], '.1%'):>9}"
              f"{r['prefix_cache_hit_tokens']:>7}{fmt(hit_rate(r), '.0%'):>5}{r['largest_batch']:>8}"
              f"{fmt(r['mean_running']):>8}"
              f"{r['preemptions']:>8}{r['num_steps']:>6}{fmt(r['canary_gflops'], '.0f'):>7}")
    print("  (waste: slots in use holding no token, mean over steps and peak; of cache: the same slots as a share "
          "of the whole cache, mean; hits: prompt tokens found in the prefix cache (a recompute after preemption looks "
          "its prompt up again), rate: of the tokens looked up; largest: the most sequences "
          "running at once; running: the mean; canary: GFLOP/s of a matmul probe before the run, to compare load)")
    if res.get("repeats", 1) > 1:
        print("  tokens/s of every run (the median one above): "
              + "; ".join(f"{bs}: " + " ".join(f"{t:.0f}" for t in r["tokens_per_s_runs"])
                          for bs, r in res["runs"].items()))


def hit_rate(run: dict) -> float | None:
    queried = run["prefix_cache_query_tokens"]
    return run["prefix_cache_hit_tokens"] / queried if queried else None


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = res["runs"]
    sizes = list(runs)
    fig, axes = plt.subplots(1, 4, figsize=(22, 4.5))
    ax = axes[0]
    ax.plot(sizes, [100 * runs[b]["kv_waste"]["mean"] for b in sizes], "o-", label="of slots in use, mean")
    ax.plot(sizes, [100 * runs[b]["kv_waste"]["peak"] for b in sizes], "o--", label="of slots in use, peak")
    ax.plot(sizes, [100 * runs[b]["kv_waste"]["of_cache_mean"] for b in sizes], "s-", label="of the whole cache, mean")
    ax.set(xlabel="block size (tokens)", ylabel="KV slots holding no token (%)", title="KV waste")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.bar(sizes, [runs[b]["largest_batch"] for b in sizes], color="#6fa8dc", label="largest")
    ax.plot(sizes, [runs[b]["mean_running"] for b in sizes], "ko-", label="mean")
    ax.set(xlabel="block size (tokens)", ylabel="running sequences", title=f"Batch held by {res['kv_slots']} KV slots")
    ax.legend(fontsize=8)
    ax = axes[2]
    ax.bar(sizes, [runs[b]["tokens_per_s"] for b in sizes], color="#93c47d")
    ax.set(xlabel="block size (tokens)", ylabel="output tokens/s", title="Throughput")
    twin = ax.twinx()
    twin.plot(sizes, [runs[b]["ttft_s"]["p50"] for b in sizes], "ko-", label="TTFT p50")
    twin.plot(sizes, [runs[b]["ttft_s"]["p99"] for b in sizes], "k^--", label="TTFT p99")
    twin.set_ylabel("seconds")
    twin.legend(fontsize=8)
    ax = axes[3]
    for b in sizes:
        curve = runs[b]["waste_curve"]
        ax.plot([c[0] for c in curve], [100 * c[1] for c in curve], label=f"block {b}")
    ax.set(xlabel="seconds since start", ylabel="waste of slots in use (%)", title="KV waste over the run")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.block_size", description=__doc__.split("\n\n")[0])
    add_workload_args(p)
    p.set_defaults(num_requests=64, max_output=200, max_prompt=200)
    p.add_argument("--block-sizes", type=int, nargs="+", default=list(BLOCK_SIZES))
    p.add_argument("--kv-slots", type=int, default=8192, help="token slots of KV memory at every block size")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1, help="run every size this many times, order alternated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    apply_quick(args)
    if args.quick:
        args.kv_slots = min(args.kv_slots, 512)  # one or two requests at a time: later ones find cached blocks
    if any(args.kv_slots % b for b in args.block_sizes):
        p.error("--kv-slots must be a multiple of every block size")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.time()
    res = {"command": "python -m bench.block_size " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": machine_info()}
    res.update(roofline.in_thread(lambda: measure(args), args.threads))
    res["elapsed_s"] = time.time() - started
    res["loadavg_at_end"] = os.getloadavg()  # other processes' load skews tokens/s, not waste or batch
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "block_size.json").write_text(json.dumps(res, indent=1))
    plot(res, args.out_dir / "block_size.png")
    report(res)
    print(f"\nwrote {args.out_dir / 'block_size.json'} and {args.out_dir / 'block_size.png'} "
          f"({res['elapsed_s']:.0f} s)")
    return res


if __name__ == "__main__":
    main()
