"""Engine benchmark: HF `generate` (static batches of 16) vs this engine, static and continuous.

    python -m bench.engine                   # the full run (64 requests, outputs 8..256 tokens)
    python -m bench.engine --quick           # a tiny run, seconds
    python -m bench.engine --skip-hf --rate 2 --profile-steps 20

One process, one loaded model for both engine modes, one workload (bench/workload.py): chat
prompts of varied length, output lengths uniform in [8, max_output], `ignore_eos`, greedy, all
arriving at once; then the same prompts arriving as a Poisson process (engine static and
continuous). "Useful tokens" are each request's own output tokens: a padded HF batch runs until
its longest member is done, and the tokens it computes for finished members do not count.

Prints tokens/s, TTFT and inter-token latency p50/p99, mean batch size, KV usage, preemptions,
the ratios against the targets, and the roofline (bench/roofline.py); writes
bench/results/engine.json and bench/results/engine.png. Wall-clock figures move with the load
that other processes put on the machine: compare the ratios of one run, and see `canary_gflops`
(a matmul probe taken before each mode) to judge whether the load changed between modes.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import roofline
from bench.workload import WorkItem, add_workload_args, apply_quick, make_workload, with_arrivals

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TARGETS = {"continuous_over_hf": 5.0, "continuous_over_static": 1.6, "roofline_fraction": 0.4}


# ---- one run's record ----------------------------------------------------------------------------


@dataclass
class RunRecord:
    """Token timestamps (seconds since the run started) per request, plus per-step samples."""

    label: str
    arrivals: dict[str, float]
    expected: dict[str, int]  # request -> its own output length
    token_times: dict[str, list[float]] = field(default_factory=dict)
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time during the run (all threads)
    canary_gflops: float = 0.0
    extra: dict = field(default_factory=dict)

    def add_tokens(self, request_id: str, ids: list[int], t: float) -> int:
        """Record new tokens; returns how many of them are useful (within the request's length)."""
        times = self.token_times.setdefault(request_id, [])
        room = self.expected[request_id] - len(times)
        useful = max(0, min(room, len(ids)))
        times += [t] * useful
        self.token_ids.setdefault(request_id, []).extend(ids[:useful])
        return useful


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def dist(values: list[float]) -> dict:
    return {"p50": pct(values, 50), "p99": pct(values, 99),
            "mean": statistics.fmean(values) if values else None}


def summarize(rec: RunRecord) -> dict:
    useful = sum(len(t) for t in rec.token_times.values())
    complete = all(len(rec.token_times.get(r, [])) == n for r, n in rec.expected.items())
    ttft = [rec.token_times[r][0] - rec.arrivals[r] for r in rec.expected if rec.token_times.get(r)]
    itl = [b - a for ts in rec.token_times.values() for a, b in zip(ts, ts[1:])]
    e2e = [rec.token_times[r][-1] - rec.arrivals[r] for r in rec.expected if rec.token_times.get(r)]
    first_arrival = min(rec.arrivals.values())
    last_token = max((ts[-1] for ts in rec.token_times.values() if ts), default=first_arrival)
    span = max(last_token - first_arrival, 1e-9)
    steps = rec.steps
    out = {
        "label": rec.label, "num_requests": len(rec.expected), "complete": complete,
        "useful_tokens": useful, "wall_s": rec.wall_s, "span_s": span,
        "tokens_per_s": useful / span, "cpu_s": rec.cpu_s,
        "tokens_per_cpu_s": useful / rec.cpu_s if rec.cpu_s else None,
        "ttft_s": dist(ttft), "itl_s": dist(itl), "e2e_s": dist(e2e),
        "num_steps": len(steps),
        "mean_batch_size": mean_of(steps, "batch_size"),
        "mean_running": mean_of(steps, "num_running"),
        "kv_usage": {"mean": mean_of(steps, "kv_usage"), "peak": max_of(steps, "kv_usage")},
        "preemptions": steps[-1].get("preemptions", 0) if steps else 0,
        "canary_gflops": rec.canary_gflops,
        "step_time_ms": step_breakdown(steps),
        "completion_curve": completion_curve(rec),
    }
    out.update(rec.extra)
    return out


def mean_of(steps: list[dict], key: str) -> float | None:
    vals = [s[key] for s in steps if s.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def max_of(steps: list[dict], key: str) -> float | None:
    vals = [s[key] for s in steps if s.get(key) is not None]
    return max(vals) if vals else None


def step_breakdown(steps: list[dict]) -> dict:
    """Mean step time for decode-only steps vs steps that also carry prefill tokens."""
    out = {}
    for kind in ("decode", "mixed"):
        sel = [s for s in steps if s.get("kind") == kind]
        if sel:
            out[kind] = {"count": len(sel), "mean_ms": 1e3 * statistics.fmean(s["step_s"] for s in sel),
                         "mean_batch": statistics.fmean(s["batch_size"] for s in sel),
                         "mean_tokens": statistics.fmean(s["num_tokens"] for s in sel)}
    return out


def completion_curve(rec: RunRecord, points: int = 200) -> list[list[float]]:
    """[[t, cumulative useful tokens], ...], at most `points` points."""
    times = sorted(t for ts in rec.token_times.values() for t in ts)
    if not times:
        return []
    stride = max(1, len(times) // points)
    curve = [[round(times[i], 4), i + 1] for i in range(0, len(times), stride)]
    if curve[-1][1] != len(times):
        curve.append([round(times[-1], 4), len(times)])
    return curve


# ---- the engine ----------------------------------------------------------------------------------


def engine_settings(policy: str, max_num_seqs: int, max_num_batched_tokens: int, prefix_caching: bool = True,
                    kv_dtype: str = "auto"):
    from inferline.config.settings import Settings

    s = Settings()
    s.cache.enable_prefix_caching = prefix_caching
    s.cache.dtype = kv_dtype
    s.scheduler.policy = policy
    s.scheduler.max_num_seqs = max_num_seqs
    s.scheduler.max_num_batched_tokens = max_num_batched_tokens
    return s


def engine_request(item: WorkItem, arrival_unix: float):
    from inferline.worker.engine.request import EngineRequest, SamplingParams

    return EngineRequest(request_id=item.request_id, prompt_token_ids=item.prompt_token_ids,
                         sampling=SamplingParams(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True),
                         arrival_time=arrival_unix)


def run_engine(runner, settings, items: list[WorkItem], label: str, progress: bool = True) -> RunRecord:
    """Feed `items` at their arrival offsets and step the engine until every one is done."""
    from inferline.worker.engine.engine import LLMEngine

    eng = LLMEngine(runner, settings)
    rec = RunRecord(label, {i.request_id: i.arrival_s for i in items},
                    {i.request_id: i.max_tokens for i in items}, canary_gflops=roofline.canary_gflops())
    pending = sorted(items, key=lambda i: i.arrival_s)
    bar = make_bar(label, sum(i.max_tokens for i in items), progress)
    t0, wall0, cpu0 = time.perf_counter(), time.time(), time.process_time()
    while pending or eng.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and pending[0].arrival_s <= now:
            item = pending.pop(0)
            eng.add_request(engine_request(item, wall0 + item.arrival_s))
        if not eng.has_unfinished_requests():
            time.sleep(min(0.05, max(0.0, pending[0].arrival_s - now)))
            continue
        outputs = eng.step()
        t = time.perf_counter() - t0
        for out in outputs:
            bar.update(rec.add_tokens(out.request_id, out.new_token_ids, t))
            if out.finished and out.finish_reason != "length":
                raise RuntimeError(f"{label}: {out.request_id} finished with {out.finish_reason}: "
                                   f"{out.error_code} {out.error_message}")
        st = eng.stats()
        rec.steps.append({"t": t, "step_s": st.step_time_s, "batch_size": st.batch_size,
                          "num_running": st.num_running, "num_waiting": st.num_waiting,
                          "num_tokens": st.num_batched_tokens, "kv_usage": st.kv_cache_usage,
                          "preemptions": st.num_preemptions, "draft_tokens": st.num_draft_tokens,
                          "kind": "decode" if st.num_batched_tokens - st.num_draft_tokens == st.batch_size
                          else "mixed"})
    rec.wall_s, rec.cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    bar.close()
    rec.extra = {"policy": settings.scheduler.policy, "max_num_seqs": settings.scheduler.max_num_seqs,
                 "max_num_batched_tokens": settings.scheduler.max_num_batched_tokens,
                 "num_kv_blocks": runner.num_blocks, "block_size": runner.block_size,
                 "prefix_caching": settings.cache.enable_prefix_caching,
                 "prefix_cache_hit_tokens": eng.stats().prefix_cache_hits,
                 "speculative": settings.speculative.method,
                 "spec_draft_tokens": eng.stats().spec_draft_tokens,
                 "spec_accepted_tokens": eng.stats().spec_accepted_tokens}
    return rec


def warm_up_engine(runner) -> None:
    from inferline.worker.engine.engine import LLMEngine
    from inferline.worker.engine.request import EngineRequest, SamplingParams

    eng = LLMEngine(runner, engine_settings("continuous", 8, 512))
    for i in range(4):
        eng.add_request(EngineRequest(request_id=f"warm-{i}", prompt_token_ids=list(range(1, 40 + 20 * i)),
                                      sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
    while eng.has_unfinished_requests():
        eng.step()


# ---- the HF baseline -----------------------------------------------------------------------------


class TimingStreamer:
    """A `generate` streamer that timestamps every decoding step (the first put is the prompt)."""

    def __init__(self, on_step):
        self.on_step = on_step
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.on_step(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


def load_hf(dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    from inferline.worker.engine.models.loader import resolve_model_dir

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir()), dtype=dtype)
    return model.eval()


def hf_batch_inputs(batch: list[WorkItem], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input ids and attention mask."""
    width = max(len(i.prompt_token_ids) for i in batch)
    ids = [[pad_id] * (width - len(i.prompt_token_ids)) + i.prompt_token_ids for i in batch]
    mask = [[0] * (width - len(i.prompt_token_ids)) + [1] * len(i.prompt_token_ids) for i in batch]
    return torch.tensor(ids), torch.tensor(mask)


@torch.inference_mode()
def run_hf(model, tokenizer, items: list[WorkItem], batch_size: int = 16, progress: bool = True) -> RunRecord:
    """Static batches of `batch_size` in arrival order (all at t=0), each generating its longest
    member's length; a request's tokens past its own length are computed but not counted."""
    label = f"hf_static{batch_size}"
    rec = RunRecord(label, {i.request_id: 0.0 for i in items}, {i.request_id: i.max_tokens for i in items},
                    canary_gflops=roofline.canary_gflops())
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    bar = make_bar(label, sum(i.max_tokens for i in items), progress)
    t0, cpu0 = time.perf_counter(), time.process_time()
    padded_tokens = 0
    for start in range(0, len(items), batch_size):
        batch = items[start:start + batch_size]
        n = max(i.max_tokens for i in batch)
        padded_tokens += n * len(batch)
        last = [time.perf_counter(), 0]  # previous step's time, steps so far in this batch

        def on_step(ids, batch=batch, last=last):
            t = time.perf_counter() - t0
            useful = sum(rec.add_tokens(item.request_id, [tok], t) for item, tok in zip(batch, ids))
            last[1] += 1
            now = time.perf_counter()
            rec.steps.append({"t": t, "step_s": now - last[0], "batch_size": len(batch),
                              "num_running": sum(1 for item in batch if item.max_tokens >= last[1]),
                              "num_tokens": len(batch), "kind": "decode" if last[1] > 1 else "mixed"})
            last[0] = now
            bar.update(useful)

        input_ids, mask = hf_batch_inputs(batch, pad_id)
        model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad_id,
                       streamer=TimingStreamer(on_step))
    rec.wall_s, rec.cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    bar.close()
    useful = sum(i.max_tokens for i in items)
    rec.extra = {"batch_size": batch_size, "computed_tokens": padded_tokens,
                 "padding_waste": 1.0 - useful / padded_tokens,
                 "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    return rec


def warm_up_hf(model, tokenizer) -> None:
    items = [WorkItem(f"w{i}", [], list(range(1, 20 + 10 * i)), 3, 0.0) for i in range(2)]
    run_hf(model, tokenizer, items, batch_size=2, progress=False)


# ---- profile of the continuous engine ------------------------------------------------------------


@contextlib.contextmanager
def labelled_phases(eng):
    """Wrap the engine's phases in profiler labels (instance attributes only; engine code untouched)."""
    from torch.profiler import record_function

    def wrap(obj, name, label):
        fn = getattr(obj, name)

        def wrapped(*a, **kw):
            with record_function(label):
                return fn(*a, **kw)
        setattr(obj, name, wrapped)
        return obj, name

    patched = [wrap(eng.scheduler, "schedule", "phase: schedule"),
               wrap(eng.runner, "prepare", "phase: prepare batch"),
               wrap(eng.runner.model, "forward", "phase: model forward"),
               wrap(eng.runner.model, "compute_logits", "phase: lm_head logits"),
               wrap(eng.runner.sampler, "sample", "phase: sample"),
               wrap(eng, "_update", "phase: update/detokenize")]
    try:
        yield
    finally:
        for obj, name in patched:
            delattr(obj, name)


def profile_continuous(runner, items: list[WorkItem], num_steps: int, max_num_seqs: int,
                       max_num_batched_tokens: int, skip_prefill: bool = True) -> dict:
    """torch.profiler over `num_steps` continuous-engine steps, by default once every prompt is
    prefilled (the decode steady state that dominates a run). Top ops by self CPU time, and phases."""
    from torch.profiler import ProfilerActivity, profile

    from inferline.worker.engine.engine import LLMEngine

    eng = LLMEngine(runner, engine_settings("continuous", max_num_seqs, max_num_batched_tokens))
    now = time.time()
    for item in items:
        eng.add_request(engine_request(item, now))
    while skip_prefill and eng.has_unfinished_requests():
        eng.step()
        st = eng.stats()
        if st.num_waiting == 0 and st.num_batched_tokens == st.batch_size:
            break
    batch_sizes = []
    with labelled_phases(eng), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            if not eng.has_unfinished_requests():
                break
            eng.step()
            batch_sizes.append(eng.stats().batch_size)
        elapsed = time.perf_counter() - start
    events = prof.key_averages()
    total_self = sum(e.self_cpu_time_total for e in events) or 1.0
    ops = sorted((e for e in events if not e.key.startswith("phase:")),
                 key=lambda e: e.self_cpu_time_total, reverse=True)
    top = [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3, "self_pct": 100 * e.self_cpu_time_total / total_self,
            "calls": e.count, "ms_per_step": e.self_cpu_time_total / 1e3 / max(1, len(batch_sizes))}
           for e in ops[:10]]
    phases = {e.key[len("phase: "):]: {"total_ms": e.cpu_time_total / 1e3,
                                        "ms_per_step": e.cpu_time_total / 1e3 / max(1, len(batch_sizes))}
              for e in events if e.key.startswith("phase:")}
    return {"num_steps": len(batch_sizes), "mean_batch_size": statistics.fmean(batch_sizes) if batch_sizes else 0,
            "ms_per_step": 1e3 * elapsed / max(1, len(batch_sizes)), "top_self_cpu": top, "phases": phases,
            "note": "profiled with torch.profiler (its overhead inflates small ops); "
                    + ("decode steady state" if skip_prefill else "from the first step")}


# ---- report --------------------------------------------------------------------------------------


def make_bar(label: str, total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=f"{label:>20}", unit="tok", disable=not enabled, mininterval=1.0,
                file=sys.stderr, leave=True)


def fmt(x, spec=".1f", scale=1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def print_table(title: str, runs: dict[str, dict]) -> None:
    print(f"\n{title}")
    head = (f"{'mode':<22}{'tok/s':>8}{'tok/cpu-s':>10}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>10}{'p99':>8}"
            f"{'batch':>7}{'running':>8}{'KV mean':>9}{'peak':>6}{'preempt':>8}{'canary':>8}")
    print(head)
    print("-" * len(head))
    for label, r in runs.items():
        print(f"{label:<22}{fmt(r['tokens_per_s']):>8}{fmt(r['tokens_per_cpu_s']):>10}{fmt(r['ttft_s']['p50'], '.2f'):>9}s"
              f"{fmt(r['ttft_s']['p99'], '.2f'):>7}s{fmt(r['itl_s']['p50'], '.0f', 1e3):>8}ms"
              f"{fmt(r['itl_s']['p99'], '.0f', 1e3):>6}ms{fmt(r['mean_batch_size']):>7}{fmt(r['mean_running']):>8}"
              f"{fmt(r['kv_usage']['mean'], '.0%'):>9}{fmt(r['kv_usage']['peak'], '.0%'):>6}"
              f"{r['preemptions']:>8}{fmt(r['canary_gflops'], '.0f'):>8}")
    print("  (TTFT from arrival; ITL: gaps between a request's consecutive tokens; batch: mean sequences per"
          " step (HF: padded rows); running: mean sequences still producing useful tokens; tok/cpu-s: useful tokens"
          " per CPU-second of this process, less sensitive to other load; canary: GFLOP/s of a matmul probe just before the mode, to compare machine load)")


def ratios(results: dict, key: str = "tokens_per_s") -> dict:
    """Continuous over HF and over static, and continuous over the roofline (wall-clock only)."""
    runs, roof = results["runs"], results["roofline"]["tokens_per_s"]
    cont = runs.get("engine_continuous", {}).get(key)
    hf = next((r for label, r in runs.items() if label.startswith("hf_")), None)
    out = {}
    if cont:
        if hf and hf.get(key):
            out["continuous_over_hf"] = cont / hf[key]
        if runs.get("engine_static", {}).get(key):
            out["continuous_over_static"] = cont / runs["engine_static"][key]
        if key == "tokens_per_s":
            out["roofline_fraction"] = cont / roof
    return out


def ceiling(results: dict) -> dict:
    """What the roofline allows on this workload. The throughput above counts output tokens only,
    but the model also computes every prompt token: each token fed in costs one pass of the
    decoder's linears, each output token one LM head (a prompt token's logits are never needed,
    and the last output token is never fed back). At the roofline's FLOP/s that work takes a
    minimum time, which caps the output rate even at 100% efficiency. Also the continuous
    engine's FLOPs actually computed (prompt tokens from the prefix cache are not) over its span,
    as a fraction of the roofline's FLOP/s: its model FLOPs utilization."""
    w, roof = results["workload"], results["roofline"]
    fpt, peak = roof["flops_per_token"], roof["gflops"] * 1e9
    prompt, output, n = w["prompt_tokens"]["total"], w["output_tokens"]["total"], w["num_requests"]

    def work(prompt_tokens: int, output_tokens: int) -> float:
        return (prompt_tokens + output_tokens - n) * fpt["decoder_linears"] + output_tokens * fpt["lm_head"]

    best = output / (work(prompt, output) / peak)
    out = {"output_tokens_per_s_at_roofline": best, "roofline_fraction_at_best": best / roof["tokens_per_s"]}
    hf = next((r for label, r in results["runs"].items() if label.startswith("hf_")), None)
    if hf and hf.get("tokens_per_s"):
        out["over_hf_at_best"] = best / hf["tokens_per_s"]
    cont = results["runs"].get("engine_continuous")
    if cont and cont.get("complete"):
        hits = cont.get("prefix_cache_hit_tokens", 0)  # found in the prefix cache: not computed
        out["continuous_prefix_cache_hit_tokens"] = hits
        out["continuous_flops_utilization"] = work(prompt - hits, cont["useful_tokens"]) / cont["span_s"] / peak
    return out


def print_ceiling(c: dict) -> None:
    print(f"  ceiling: with every FLOP at the roofline's rate, this workload (prompts included) gives at most "
          f"{c['output_tokens_per_s_at_roofline']:.0f} output tok/s = {c['roofline_fraction_at_best']:.0%} of the "
          f"roofline" + (f", {c['over_hf_at_best']:.2f}x HF" if "over_hf_at_best" in c else ""))
    if "continuous_flops_utilization" in c:
        print(f"  continuous: model FLOPs utilization {c['continuous_flops_utilization']:.0%} of the roofline's FLOP/s "
              f"(prompt and output work; {c['continuous_prefix_cache_hit_tokens']} prompt tokens came from the "
              f"prefix cache and were not computed)")


def print_report(results: dict) -> None:
    roof = results["roofline"]
    fpt = roof["flops_per_token"]
    print(f"\nRoofline ({roof['dtype']}, {roof['threads']} threads): FLOPs/token = "
          f"{fpt['total'] / 1e6:.0f} M ({fpt['decoder_linears'] / 1e6:.0f} M decoder linears + "
          f"{fpt['lm_head'] / 1e6:.0f} M lm_head)")
    for b, r in roof["by_batch"].items():
        print(f"  batch {b:>4}: {r['gflops']:6.1f} GFLOP/s -> {r['tokens_per_s']:6.0f} tokens/s"
              + (f" ({r['backend']})" if "backend" in r else ""))
    print(f"  roofline: {roof['tokens_per_s']:.0f} tokens/s ({roof['gflops']:.1f} GFLOP/s)"
          + (f"; re-measured at the end: {results['roofline_end']['tokens_per_s']:.0f} tokens/s"
             if results.get("roofline_end") else ""))
    w = results["workload"]
    print(f"\nWorkload: {w['num_requests']} requests, prompts {w['prompt_tokens']['min']}-"
          f"{w['prompt_tokens']['max']} tokens (mean {w['prompt_tokens']['mean']:.0f}), outputs "
          f"{w['output_tokens']['min']}-{w['output_tokens']['max']} (mean {w['output_tokens']['mean']:.0f}, "
          f"total {w['output_tokens']['total']}), greedy, ignore_eos; the engine's K/V cache: "
          f"{results.get('kv_dtype', 'float32')}")
    print_table(f"All requests at t=0 (engine_static: {results.get('static_seats')} seats; continuous: "
                f"{results['args'].get('max_num_seqs')}):", results["runs"])
    if results.get("poisson"):
        p = results["poisson"]
        print_table(f"Poisson arrivals at {p['rate_rps']:.2f} req/s ({p['rate_source']}):", p["runs"])
    print("\nRatios (same run) vs targets:")
    for key, value in results["ratios"].items():
        target = TARGETS[key]
        shown = f"{value:.0%}" if key == "roofline_fraction" else f"{value:.2f}x"
        goal = f"{target:.0%}" if key == "roofline_fraction" else f"{target:.1f}x"
        print(f"  {key:<24}{shown:>8}   target >= {goal:<6} {'MET' if value >= target else 'not met'}")
    if results.get("ceiling"):
        print_ceiling(results["ceiling"])
    if results.get("repeats"):
        pairs = results["repeats"]["continuous_over_static"]
        print(f"  {len(pairs)} repetitions of the engine modes, alternated (the median run of each is reported): "
              "continuous_over_static " + " ".join(f"{r:.2f}x" for r in pairs))
    cpu = results.get("ratios_per_cpu_s") or {}
    if cpu:
        print("  per CPU-second (robust to other load): "
              + ", ".join(f"{k} {v:.2f}x" for k, v in cpu.items()))
    if results.get("profile"):
        prof = results["profile"]
        print(f"\nProfile of the continuous engine ({prof['num_steps']} steps, mean batch "
              f"{prof['mean_batch_size']:.1f}, {prof['ms_per_step']:.0f} ms/step under the profiler; {prof['note']}):")
        for name, ph in prof["phases"].items():
            print(f"  {name:<22}{ph['ms_per_step']:8.1f} ms/step")
        print(f"  {'op':<48}{'self ms/step':>13}{'self %':>8}{'calls':>8}")
        for r in prof["top_self_cpu"]:
            print(f"  {r['op'][:48]:<48}{r['ms_per_step']:13.1f}{r['self_pct']:7.1f}%{r['calls']:8d}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if results.get("poisson") else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    runs = results["runs"]
    ax = axes[0]
    labels = list(runs)
    values = [runs[k]["tokens_per_s"] for k in labels]
    bars = ax.bar(labels, values, color=["#999999", "#6fa8dc", "#e69138", "#93c47d"][:len(labels)])
    ax.bar_label(bars, fmt="%.0f")
    roof = results["roofline"]["tokens_per_s"]
    ax.axhline(roof, color="k", ls="--", lw=1, label=f"roofline {roof:.0f} tok/s")
    ax.axhline(TARGETS["roofline_fraction"] * roof, color="r", ls=":", lw=1, label="40% of roofline")
    ax.set_ylabel("useful tokens/s")
    ax.set_title("Throughput, all requests at t=0")
    ax.tick_params(axis="x", labelrotation=15)
    ax.legend(fontsize=8)
    curves(axes[1], runs, "Tokens completed over time (t=0 arrivals)")
    if results.get("poisson"):
        p = results["poisson"]
        curves(axes[2], p["runs"], f"Poisson arrivals, {p['rate_rps']:.2f} req/s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def curves(ax, runs: dict, title: str) -> None:
    for label, r in runs.items():
        curve = r["completion_curve"]
        if curve:
            ax.plot([c[0] for c in curve], [c[1] for c in curve], label=label)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("useful tokens completed")
    ax.set_title(title)
    ax.legend(fontsize=8)


# ---- main ----------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.split("\n\n")[0])
    add_workload_args(p)
    p.add_argument("--skip-hf", action="store_true", help="skip the HF generate baseline")
    p.add_argument("--rate", default="auto",
                   help="Poisson arrivals in requests/s; 'auto' = 80%% of the continuous engine's measured "
                        "capacity; 0 or 'none' skips the Poisson variant")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--static-seats", type=int, default=0,
                   help="seats of the engine's static policy (default: --hf-batch-size, the static-batching baseline)")
    p.add_argument("--extra-static-seats", type=int, default=0,
                   help="also run the engine's static policy with this many seats (e.g. 16, as HF)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the two engine modes this many times, alternating their order, and report the "
                        "median run of each (HF runs once)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after the runs, profile this many continuous-engine steps (decode steady state)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="engine modes without prefix caching (every prompt token computed, as HF does)")
    p.add_argument("--kv-dtype", choices=("auto", "float16"), default="auto",
                   help="the engine modes' K/V cache (INFERLINE_CACHE__DTYPE): float16 halves the bytes decode "
                        "attention reads, at the cost of rounding K/V (HF keeps fp32)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    apply_quick(args)
    return args


def workload_stats(items: list[WorkItem]) -> dict:
    prompts = [len(i.prompt_token_ids) for i in items]
    outs = [i.max_tokens for i in items]
    return {"num_requests": len(items),
            "prompt_tokens": {"min": min(prompts), "max": max(prompts), "mean": statistics.fmean(prompts),
                              "total": sum(prompts)},
            "output_tokens": {"min": min(outs), "max": max(outs), "mean": statistics.fmean(outs), "total": sum(outs)}}


def check_agreement(results_runs: dict[str, RunRecord]) -> dict:
    """How many requests produced the same greedy tokens in each mode as in the first mode."""
    labels = list(results_runs)
    if len(labels) < 2:
        return {}
    ref = results_runs[labels[0]].token_ids
    return {f"{label}_vs_{labels[0]}": sum(results_runs[label].token_ids.get(r) == ids for r, ids in ref.items())
            for label in labels[1:]}


def main(argv=None) -> dict:
    args = parse_args(argv)
    # On a thread of its own, as the worker's EngineLoop steps the engine: which thread runs
    # torch changes its speed (docs/benchmarks.md, "The in-process engine steps on a thread").
    return roofline.in_thread(lambda: run_all(args, argv), args.threads)


def run_all(args: argparse.Namespace, argv) -> dict:
    progress = not args.no_progress
    from inferline.worker.engine.model_runner import ModelRunner

    started = time.time()
    caching = not args.no_prefix_caching
    base = engine_settings("continuous", args.max_num_seqs, args.max_num_batched_tokens, caching, args.kv_dtype)
    runner = ModelRunner(base)
    items = make_workload(runner.tokenizer, args.num_requests, max_output=args.max_output,
                          max_prompt=args.max_prompt, seed=args.seed)
    results = {"command": "python -m bench.engine " + " ".join(argv if argv is not None else sys.argv[1:]),
               "machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
               "workload": workload_stats(items), "kv_dtype": str(runner.kv_dtype).removeprefix("torch.")}
    print(f"measuring the roofline ({runner.dtype}, {torch.get_num_threads()} threads)...", file=sys.stderr)
    results["roofline"] = roofline.measure(runner.model, batches=(64,) if args.quick else (64, 128, 256),
                                           repeats=1 if args.quick else 5)

    records: dict[str, RunRecord] = {}
    if not args.skip_hf:
        hf = load_hf(runner.dtype)
        warm_up_hf(hf, runner.tokenizer)
        records[f"hf_static{args.hf_batch_size}"] = run_hf(hf, runner.tokenizer, items, args.hf_batch_size, progress)
        del hf
    warm_up_engine(runner)
    gc.freeze()  # as the worker's EngineLoop does once its engine is built
    # Static batching runs fixed batches to completion: with as many seats as requests it would
    # be the continuous schedule minus nothing (all-at-once arrivals never refill), so the
    # baseline gets HF's batch size unless told otherwise (--extra-static-seats adds another).
    static_seats = args.static_seats or args.hf_batch_size
    results["static_seats"] = static_seats
    static = engine_settings("static", static_seats, args.max_num_batched_tokens, caching, args.kv_dtype)
    repeated = alternate_modes(runner, {"engine_static": static, "engine_continuous": base}, items, args.repeats,
                               progress)
    records["engine_static"] = median_run(repeated["engine_static"])
    if args.extra_static_seats:
        seats = engine_settings("static", args.extra_static_seats, args.max_num_batched_tokens, caching,
                                args.kv_dtype)
        label = f"engine_static{args.extra_static_seats}"
        records[label] = run_engine(runner, seats, items, label, progress)
    records["engine_continuous"] = median_run(repeated["engine_continuous"])
    results["runs"] = {label: summarize(rec) for label, rec in records.items()}
    if args.repeats > 1:
        results["repeats"] = repeat_spread(repeated)
    results["greedy_agreement"] = check_agreement(records)
    results["ratios"] = ratios(results)
    results["ratios_per_cpu_s"] = ratios(results, "tokens_per_cpu_s")
    results["ceiling"] = ceiling(results)

    rate, source = poisson_rate(args.rate, results, items)
    if rate:
        arriving = with_arrivals(items, rate, args.seed)
        p_records = {"engine_static": run_engine(runner, static, arriving, "poisson_static", progress),
                     "engine_continuous": run_engine(runner, base, arriving, "poisson_continuous", progress)}
        p_runs = {k: summarize(r) for k, r in p_records.items()}
        results["poisson"] = {"rate_rps": rate, "rate_source": source, "runs": p_runs,
                              "continuous_over_static": p_runs["engine_continuous"]["tokens_per_s"]
                              / p_runs["engine_static"]["tokens_per_s"],
                              "ttft_p50_static_over_continuous": safe_div(
                                  p_runs["engine_static"]["ttft_s"]["p50"], p_runs["engine_continuous"]["ttft_s"]["p50"])}
    if args.profile_steps:
        print("profiling the continuous engine...", file=sys.stderr)
        results["profile"] = profile_continuous(runner, items, args.profile_steps, args.max_num_seqs,
                                                args.max_num_batched_tokens)
    if not args.quick:  # did the machine's load change over the run?
        results["roofline_end"] = roofline.measure(runner.model, batches=(256,), repeats=3)
    gc.unfreeze()  # as EngineLoop.stop does
    results["targets"] = TARGETS
    results["elapsed_s"] = time.time() - started
    write_outputs(results, args.out_dir)
    print_report(results)
    print(f"\nwrote {args.out_dir / 'engine.json'} and {args.out_dir / 'engine.png'} "
          f"({results['elapsed_s']:.0f} s)")
    return results


def alternate_modes(runner, modes: dict, items: list[WorkItem], repeats: int, progress: bool) -> dict:
    """Each engine mode (label -> settings) `repeats` times, in turn forward and backward (S C, C S,
    S C, ...): the machine's load drifts over minutes, and a ratio of one run of each can take
    that drift for a speed-up. label -> its runs in order."""
    runs: dict[str, list[RunRecord]] = {label: [] for label in modes}
    order = list(modes.items())
    for i in range(repeats):
        for label, settings in order if i % 2 == 0 else order[::-1]:
            runs[label].append(run_engine(runner, settings, items, label, progress))
    return runs


def median_run(runs: list[RunRecord]) -> RunRecord:
    """The run with the median tokens/s (the lower one of an even count)."""
    ranked = sorted(runs, key=lambda rec: summarize(rec)["tokens_per_s"])
    return ranked[(len(ranked) - 1) // 2]


def repeat_spread(repeated: dict[str, list[RunRecord]]) -> dict:
    """Tokens/s of every repetition, and continuous/static within each (the two ran side by side)."""
    tps = {label: [summarize(rec)["tokens_per_s"] for rec in runs] for label, runs in repeated.items()}
    pairs = [c / s for s, c in zip(tps["engine_static"], tps["engine_continuous"])]
    return {"tokens_per_s": tps, "continuous_over_static": pairs,
            "continuous_over_static_range": [min(pairs), max(pairs)]}


def safe_div(a, b):
    return a / b if a is not None and b else None


def poisson_rate(arg: str, results: dict, items: list[WorkItem]) -> tuple[float | None, str]:
    if str(arg).lower() in ("0", "none", "off", ""):
        return None, "off"
    if str(arg).lower() == "auto":
        capacity = results["runs"]["engine_continuous"]["tokens_per_s"] / results["workload"]["output_tokens"]["mean"]
        return 0.8 * capacity, "auto: 80% of the continuous engine's capacity measured above"
    return float(arg), "--rate"


def write_outputs(results: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "engine.json").write_text(json.dumps(results, indent=1))
    plot(results, out_dir / "engine.png")


def machine_info() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "loadavg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


if __name__ == "__main__":
    main()
