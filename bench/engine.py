"""Engine benchmark: HF `generate` (static batches of 16) against this engine's static and
continuous batching on one workload, then the same prompts arriving as a Poisson process.

    python -m bench.engine                   # 64 requests, outputs 8..256 tokens
    python -m bench.engine --quick           # a tiny run, seconds
    python -m bench.engine --skip-hf --rate 2 --repeats 3

One process, one loaded model, bench/workload.py's requests (greedy, ignore_eos, all at t=0).
Useful tokens are each request's own: a padded HF batch runs to its longest member, and what it
computes past a member's length does not count. Prints tokens/s, TTFT and inter-token p50/p99,
batch and KV usage, the ratios against TARGETS and the roofline; writes
bench/results/engine.json. `canary`, a matmul probe before each run, shows the machine's load.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from bench import roofline, stats
from bench.workload import WorkItem, add_workload_args, describe, from_args, line, parse
from bench.workload import with_arrivals

TARGETS = {"continuous_over_hf": 5.0, "continuous_over_static": 1.6, "roofline_fraction": 0.4}


@dataclass
class RunRecord:
    """Token times (seconds since the run started) and ids per request, and per-step samples."""

    label: str
    arrivals: dict[str, float]
    expected: dict[str, int]  # request -> its own output length
    token_times: dict[str, list[float]] = field(default_factory=dict)
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)
    cpu_s: float = 0.0  # this process's CPU time during the run (all threads)
    canary_gflops: float = field(default_factory=roofline.canary_gflops)
    extra: dict = field(default_factory=dict)

    def add_tokens(self, request_id: str, ids: list[int], t: float) -> None:
        """Record new tokens, the useful ones only (within the request's length)."""
        times = self.token_times.setdefault(request_id, [])
        useful = ids[: max(0, self.expected[request_id] - len(times))]
        times += [t] * len(useful)
        self.token_ids.setdefault(request_id, []).extend(useful)


def summarize(rec: RunRecord) -> dict:
    timed = [
        stats.Timed(rec.arrivals[r], ts[0] if ts else None, ts[-1] if ts else 0.0, len(ts))
        for r in rec.expected
        for ts in [rec.token_times.get(r, [])]
    ]
    out = stats.summarize(timed, sum(rec.expected.values()))
    steps = rec.steps

    def mean(key, sel=steps):
        values = [s[key] for s in sel if s.get(key) is not None]
        return statistics.fmean(values) if values else None

    kinds = {k: [s for s in steps if s["kind"] == k] for k in ("decode", "mixed")}
    peak = max((s.get("kv_cache_usage") or 0 for s in steps), default=0)
    out.update(
        label=rec.label,
        cpu_s=rec.cpu_s,
        canary_gflops=rec.canary_gflops,
        tokens_per_cpu_s=out["useful_tokens"] / rec.cpu_s if rec.cpu_s else None,
        itl_s=stats.dist(b - a for ts in rec.token_times.values() for a, b in zip(ts, ts[1:])),
        num_steps=len(steps),
        mean_batch_size=mean("batch_size"),
        mean_running=mean("num_running"),
        kv_usage={"mean": mean("kv_cache_usage"), "peak": peak},
        preemptions=steps[-1].get("num_preemptions", 0) if steps else 0,
        step_time_ms={
            k: {"count": len(sel), "mean_ms": 1e3 * mean("step_time_s", sel)}
            for k, sel in kinds.items()
            if sel
        },
        **rec.extra,
    )
    return out


def lengths(items: list[WorkItem]) -> dict[str, int]:
    return {i.request_id: i.max_tokens for i in items}


@contextlib.contextmanager
def gc_frozen():
    """gc.freeze() as the worker's EngineLoop does once its engine is built, unfrozen after."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# ---- the engine -----------------------------------------------------------------------------


def engine_settings(policy: str, seats: int, budget: int, prefix_caching=True, kv_dtype="auto"):
    from inferline.config.settings import Settings

    s = Settings()
    s.cache.enable_prefix_caching, s.cache.dtype = prefix_caching, kv_dtype
    s.scheduler.policy, s.scheduler.max_num_seqs = policy, seats
    s.scheduler.max_num_batched_tokens = budget
    return s


def engine_request(item: WorkItem, arrival_unix: float):
    from inferline.worker.engine.request import EngineRequest, SamplingParams

    return EngineRequest(
        request_id=item.request_id,
        prompt_token_ids=item.prompt_token_ids,
        sampling=SamplingParams(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True),
        arrival_time=arrival_unix,
    )


def run_engine(runner, settings, items: list[WorkItem], label: str) -> RunRecord:
    """Feed `items` at their arrival offsets and step the engine until every one is done."""
    from inferline.worker.engine.engine import LLMEngine

    eng = LLMEngine(runner, settings)
    rec = RunRecord(label, {i.request_id: i.arrival_s for i in items}, lengths(items))
    pending = sorted(items, key=lambda i: i.arrival_s)
    t0, wall0, cpu0 = time.perf_counter(), time.time(), time.process_time()
    while pending or eng.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and pending[0].arrival_s <= now:
            eng.add_request(engine_request(item := pending.pop(0), wall0 + item.arrival_s))
        if not eng.has_unfinished_requests():
            time.sleep(min(0.05, max(0.0, pending[0].arrival_s - now)))
            continue
        outputs, t = eng.step(), time.perf_counter() - t0
        for out in outputs:
            rec.add_tokens(out.request_id, out.new_token_ids, t)
            if out.finished and out.finish_reason != "length":
                raise RuntimeError(
                    f"{label}: {out.request_id} ended {out.finish_reason}: "
                    f"{out.error_code} {out.error_message}"
                )
        st = eng.stats()
        decode = st.num_batched_tokens - st.num_draft_tokens == st.batch_size
        rec.steps.append({"t": t, "kind": "decode" if decode else "mixed", **asdict(st)})
    rec.cpu_s = time.process_time() - cpu0
    st = eng.stats()
    rec.extra = {
        "policy": settings.scheduler.policy,
        "max_num_seqs": eng.scheduler.max_num_seqs,
        "block_size": runner.block_size,
        "num_blocks": eng.block_manager.num_blocks,
        "prefix_cache_hit_tokens": st.prefix_cache_hits,
        "prefix_cache_query_tokens": st.prefix_cache_queries,
        "spec_draft_tokens": st.spec_draft_tokens,
        "spec_accepted_tokens": st.spec_accepted_tokens,
    }
    print(f"{label}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return rec


def warm_up_engine(runner) -> None:
    from inferline.worker.engine.engine import LLMEngine

    eng = LLMEngine(runner, engine_settings("continuous", 8, 512))
    for i in range(4):
        item = WorkItem(f"warm-{i}", [], list(range(1, 40 + 20 * i)), 4, 0)
        eng.add_request(engine_request(item, time.time()))
    while eng.has_unfinished_requests():
        eng.step()


# ---- the HF baseline ------------------------------------------------------------------------


class TimingStreamer:
    """A `generate` streamer that timestamps every decoding step (the first put is the prompt)."""

    def __init__(self, on_step):
        self.on_step, self.seen_prompt = on_step, False

    def put(self, value: torch.Tensor) -> None:
        if self.seen_prompt:
            self.on_step(value.reshape(-1).tolist())
        self.seen_prompt = True

    def end(self) -> None:
        pass


def load_hf(dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    from inferline.worker.engine.models.loader import resolve_model_dir

    return AutoModelForCausalLM.from_pretrained(str(resolve_model_dir()), dtype=dtype).eval()


@torch.inference_mode()
def run_hf(model, tokenizer, items: list[WorkItem], batch_size: int = 16) -> RunRecord:
    """Static batches of `batch_size` (all at t=0), left-padded, each generating its longest
    member's length; a request's tokens past its own length are computed but not counted."""
    rec = RunRecord(f"hf_static{batch_size}", {i.request_id: 0.0 for i in items}, lengths(items))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    t0, cpu0 = time.perf_counter(), time.process_time()
    for start in range(0, len(items), batch_size):
        batch = items[start : start + batch_size]
        n, width = max(i.max_tokens for i in batch), max(len(i.prompt_token_ids) for i in batch)
        last = [time.perf_counter(), "mixed"]  # the first step computes the prompts

        def on_step(ids, batch=batch, last=last):
            t = time.perf_counter() - t0
            for item, tok in zip(batch, ids):
                rec.add_tokens(item.request_id, [tok], t)
            took = time.perf_counter() - last[0]
            rec.steps.append(
                {"t": t, "step_time_s": took, "kind": last[1], "batch_size": len(batch)}
            )
            last[:] = time.perf_counter(), "decode"

        pads = [width - len(i.prompt_token_ids) for i in batch]
        ids = torch.tensor([[pad] * p + i.prompt_token_ids for p, i in zip(pads, batch)])
        mask = torch.tensor([[0] * p + [1] * (width - p) for p in pads])
        greedy = dict(do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad)
        streamer = TimingStreamer(on_step)
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            streamer=streamer,
            **greedy,
        )
    rec.cpu_s = time.process_time() - cpu0
    return rec


# ---- report and main ------------------------------------------------------------------------


def print_table(title: str, runs: dict[str, dict]) -> None:
    fmt = stats.fmt
    head = (
        f"{'mode':<20}{'tok/s':>8}{'tok/cpu-s':>10}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}"
        f"{'p99':>7}{'batch':>7}{'KV peak':>8}{'preempt':>8}{'canary':>7}"
    )
    print(f"\n{title}\n{head}\n" + "-" * len(head))
    for label, r in runs.items():
        t, i = r["ttft_s"], r["itl_s"]
        print(
            f"{label:<20}{fmt(r['tokens_per_s']):>8}{fmt(r['tokens_per_cpu_s']):>10}"
            f"{fmt(t['p50'], '.2f'):>9}s{fmt(t['p99'], '.2f'):>7}s{fmt(i['p50'], '.3f'):>8}s"
            f"{fmt(i['p99'], '.3f'):>6}s{fmt(r['mean_batch_size']):>7}"
            f"{fmt(r['kv_usage']['peak'], '.0%'):>8}{r['preemptions']:>8}"
            f"{fmt(r['canary_gflops'], '.0f'):>7}"
        )


def print_report(res: dict) -> None:
    roof, w = res["roofline"], res["workload"]
    print(
        f"\nroofline ({roof['dtype']}, {roof['threads']} threads): "
        f"{roof['tokens_per_s']:.0f} tokens/s ({roof['gflops']:.1f} GFLOP/s)"
    )
    print(f"workload: {line(w)}, greedy, ignore_eos")
    print_table(f"All at t=0 (engine_static: {res['static_seats']} seats):", res["runs"])
    if p := res.get("poisson"):
        print_table(f"Poisson arrivals at {p['rate_rps']:.2f} req/s:", p["runs"])
    print("\nratios (one run) against the targets:")
    for key, value in res["ratios"].items():
        met = "MET" if value >= TARGETS[key] else "not met"
        print(f"  {key:<24}{value:8.2f}   target >= {TARGETS[key]:<5} {met}")
    print(f"greedy tokens equal to the first mode's: {res['greedy_agreement']}")


def parse_args(argv=None):
    p = stats.parser("engine", __doc__, threads=0, out="engine.json")
    add_workload_args(p)
    p.add_argument("--skip-hf", action="store_true", help="skip the HF generate baseline")
    rate = "Poisson arrivals in requests/s; 'auto': 80%% of continuous's capacity; 0: none"
    p.add_argument("--rate", default="auto", help=rate)
    p.add_argument("--hf-batch-size", type=int, default=16, help="also the static engine's seats")
    p.add_argument("--repeats", type=int, default=1, help="modes in ABBA order; the median run")
    args = parse(p, argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    # On a thread of its own, as the worker's EngineLoop steps the engine (docs/benchmarks.md).
    return roofline.in_thread(lambda: run_all(args, argv), args.threads)


def run_all(args, argv) -> dict:
    from inferline.worker.engine.model_runner import ModelRunner

    started, budget = time.time(), args.max_num_batched_tokens
    modes = {
        "engine_static": engine_settings("static", args.hf_batch_size, budget),
        "engine_continuous": engine_settings("continuous", args.max_num_seqs, budget),
    }
    runner = ModelRunner(modes["engine_continuous"])
    items = from_args(runner.tokenizer, args)
    batches, repeats = ((64,), 1) if args.quick else ((64, 256), 5)
    res = stats.header("engine", argv, targets=TARGETS, static_seats=args.hf_batch_size)
    res.update(workload=describe(items), roofline=roofline.measure(runner.model, batches, repeats))
    records: dict[str, RunRecord] = {}
    if not args.skip_hf:
        hf, seats = load_hf(runner.dtype), args.hf_batch_size
        run_hf(hf, runner.tokenizer, [WorkItem("w", [], list(range(1, 20)), 3, 0.0)], 2)  # warm-up
        records[f"hf_static{seats}"] = run_hf(hf, runner.tokenizer, items, seats)
        del hf
    warm_up_engine(runner)
    with gc_frozen():
        repeated: dict[str, list[RunRecord]] = {label: [] for label in modes}
        for label in stats.abba(list(modes), args.repeats):
            repeated[label].append(run_engine(runner, modes[label], items, label))
        for label, recs in repeated.items():
            records[label] = stats.median_run(recs, lambda r: summarize(r)["tokens_per_s"])
        runs = res["runs"] = {label: summarize(rec) for label, rec in records.items()}
        first = next(iter(records.values())).token_ids
        res["greedy_agreement"] = {
            label: sum(rec.token_ids.get(r) == ids for r, ids in first.items())
            for label, rec in list(records.items())[1:]
        }
        cont = runs["engine_continuous"]["tokens_per_s"]
        res["ratios"] = {
            "continuous_over_static": cont / runs["engine_static"]["tokens_per_s"],
            "roofline_fraction": cont / res["roofline"]["tokens_per_s"],
        }
        if hf_run := runs.get(f"hf_static{args.hf_batch_size}"):
            res["ratios"]["continuous_over_hf"] = cont / hf_run["tokens_per_s"]
        rate = 0.8 * cont * len(items) / res["workload"]["total_output"]
        rate = rate if args.rate == "auto" else float(args.rate)
        if rate:
            arriving = with_arrivals(items, rate, args.seed)
            res["poisson"] = {"rate_rps": rate, "runs": {}}
            for label, s in modes.items():
                rec = run_engine(runner, s, arriving, f"poisson {label}")
                res["poisson"]["runs"][label] = summarize(rec)
    return stats.save(res, args.out, started, print_report)


if __name__ == "__main__":
    main()
