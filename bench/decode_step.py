"""Decode-step micro-benchmark: ms per step of the real engine (SmolLM2) at a fixed batch of decodes.

    python -m bench.decode_step                    # batch 32, 20 timed steps, 2 threads
    python -m bench.decode_step --compare          # v0, torch, cpu, mkl, unfused and no-attn side by side
    python -m bench.decode_step --profile          # + torch.profiler, top ops by self CPU time
    python -m bench.decode_step --kv-fp16          # the K/V cache in fp32 vs fp16, side by side
    python -m bench.decode_step --linears          # linear layers on the C GEMM (codes, fp32), oneDNN, MKL

Builds the engine the way bench/engine.py does, admits `--batch` requests with the engine
benchmark's prompts (bench/workload.py) plus `--extra-context` tokens each (contexts ~100-450, a
mid-run batch), prefills them, then times whole `LLMEngine.step()` calls (schedule, prepare,
forward, logits, sampling, update) that decode one token per sequence. The machine is shared and
noisy: `--compare` interleaves the variants step by step (ABCD DCBA) in one process, on one
batch, and reports medians and ratios: v0 (the model code before issue #3, kept below), the
current code with decode attention in PyTorch (`torch`, kernels/reference.py) and in the compiled
C kernel (`cpu`, kernels/cpu/), the latter with the linear layers on F.linear instead of
the packed weights (`mkl`, models/linear.py), with norms, SiLU and rope as PyTorch ops instead of
kernels/fused.py's C kernels (`unfused`), and with decode attention skipped (outputs zeros; the step
minus it is what attention costs). `--kv-fp16` compares the default fp32 K/V cache (`cpu`) with an
fp16 copy of it (`cpu-fp16`, INFERLINE_CACHE__DTYPE=float16) on the same batch. `--linears`
compares the linear backends (INFERLINE_MODEL__CPU_LINEAR): the C GEMM over 8-bit codes (`c-codes`,
where the weights have exact ones: INFERLINE_MODEL__CPU_WEIGHT_CODES) and over fp32 panels (`c-gemm`,
kernels/cpu/gemm.py), oneDNN (`onednn`) and F.linear (`mkl`). The matmul floor
(bench/roofline.py: the step's own linear layers alone, at this batch) is timed in between. Steps
run on a thread of their own, as in the worker (see docs/benchmarks.md on OpenMP threads called
from the main thread).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import threading
import time

import torch

from bench import roofline
from bench.engine import engine_settings
from bench.workload import make_workload

# ---- v0: the decode path as it was before issue #3, kept here only for --compare ----------------

_V0_CHUNK_SEQS = 8


def gather_kv_v0(cache, block_tables, num_tokens: int, lens=None):
    num_seqs, block_size = block_tables.shape[0], cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    table = block_tables[:, :num_blocks].long()
    if lens is not None:
        used = (lens + block_size - 1) // block_size
        cols = torch.arange(num_blocks, device=table.device)
        table = table.masked_fill(cols[None, :] >= used[:, None], 0)
    gathered = torch.index_select(cache, 0, table.flatten())
    return gathered.view(num_seqs, num_blocks * block_size, *cache.shape[2:])[:, :num_tokens]


def paged_decode_attention_v0(q, k_cache, v_cache, block_tables, context_lens, scale):
    num_seqs = q.shape[0]
    out = torch.empty_like(q)
    lens = context_lens.long()
    order = torch.argsort(lens)
    for start in range(0, num_seqs, _V0_CHUNK_SEQS):
        idx = order[start:start + _V0_CHUNK_SEQS]
        sub_lens = lens[idx]
        out[idx] = _decode_chunk_v0(q[idx], k_cache, v_cache, block_tables[idx], sub_lens, int(sub_lens.max()), scale)
    return out


def _decode_chunk_v0(q, k_cache, v_cache, block_tables, lens, max_len, scale):
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = max(max_len, 1)
    valid = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]
    k = gather_kv_v0(k_cache, block_tables, max_len, lens)
    v = gather_kv_v0(v_cache, block_tables, max_len, lens)
    k = k.permute(0, 2, 1, 3).float().contiguous()
    v = torch.where(valid[:, None, :, None], v.permute(0, 2, 1, 3).float(),
                    torch.zeros((), dtype=torch.float32, device=q.device)).contiguous()
    qg = q.float().reshape(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v).reshape(num_seqs, num_heads, head_dim)
    out = out.masked_fill((lens == 0)[:, None, None], 0.0)
    return out.to(q.dtype)


def _rms_norm_v0(x, weight, eps):
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotary_v0(rotary, positions, x):
    half = x.shape[-1] // 2  # the tables are now (c, c) and (-s, s): take c and s
    cos = rotary.cos[positions, :half].unsqueeze(1)
    sin = rotary.sin[positions, half:].unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _attention_forward_v0(self, rope, hidden, k_cache, v_cache, meta):
    from inferline import kernels

    rotary, positions = rope  # the model's RotaryEmbedding (v0 kept it on each layer)
    num_tokens = hidden.shape[0]
    q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
    q = q.view(num_tokens, self.num_heads, self.head_dim)
    k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
    v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
    q, k = _rotary_v0(rotary, positions, q), _rotary_v0(rotary, positions, k)
    kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    nd = meta.num_decode_tokens
    assert nd == num_tokens, "v0 is timed on decode-only steps"
    tables = (meta.block_tables, meta.context_lens) if hasattr(meta, "block_tables") else \
        (meta.decode_block_tables, meta.decode_context_lens)  # kernels/attention.py: cpu's or the split metadata
    out = paged_decode_attention_v0(q, k_cache, v_cache, *tables, self.scale)
    return self.o_proj(out.view(num_tokens, self.q_size))


def _layer_forward_v0(self, rope, hidden, k_cache, v_cache, meta):
    hidden = hidden + self.self_attn(
        rope, _rms_norm_v0(hidden, self.input_layernorm, self.eps), k_cache, v_cache, meta)
    return hidden + self.mlp(_rms_norm_v0(hidden, self.post_attention_layernorm, self.eps))


def _model_forward_v0(self, input_ids, positions, kv_cache, meta):
    hidden = self.embed_tokens(input_ids)
    for layer, (k_cache, v_cache) in zip(self.layers, kv_cache):
        hidden = layer((self.rotary, positions), hidden, k_cache, v_cache, meta)
    return _rms_norm_v0(hidden, self.norm, self.config.rms_norm_eps)


@contextlib.contextmanager
def v0_patched(eng):
    """Swap the pre-#3 versions of the changed model code in (class attributes, restored after),
    linear layers on F.linear. Not swapped: the runner's new per-step work (length-sorted
    decodes, the decode plan it builds)."""
    from inferline.worker.engine.models import llama

    patches = [(llama.Attention, "forward", _attention_forward_v0),
               (llama.DecoderLayer, "forward", _layer_forward_v0),
               (llama.LlamaForCausalLM, "forward", _model_forward_v0)]
    saved = [(cls, name, getattr(cls, name)) for cls, name, _ in patches]
    for cls, name, fn in patches:
        setattr(cls, name, fn)
    try:
        with linears_unpacked(eng):
            yield
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


# ---- the batch ------------------------------------------------------------------------------------


def build_engine(args):
    from inferline.worker.engine.engine import LLMEngine
    from inferline.worker.engine.model_runner import ModelRunner
    from inferline.worker.engine.request import EngineRequest, SamplingParams

    settings = engine_settings("continuous", args.batch, 512)
    runner = ModelRunner(settings)
    eng = LLMEngine(runner, settings)
    items = make_workload(runner.tokenizer, args.batch, max_prompt=args.max_prompt, seed=args.seed)
    max_tokens = 1024  # more than the run takes, prefill steps included: nobody finishes
    for item in items:
        prompt = item.prompt_token_ids + (item.prompt_token_ids * 8)[:args.extra_context]
        eng.add_request(EngineRequest(request_id=item.request_id, prompt_token_ids=prompt,
                                      sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    while True:  # prefill everyone
        eng.step()
        st = eng.stats()
        if st.num_waiting == 0 and st.num_batched_tokens == st.batch_size == args.batch:
            break
        assert eng.has_unfinished_requests() and st.num_preemptions == 0, "the batch did not form"
    for _ in range(args.warmup):
        eng.step()
    return eng


def timed_step(eng) -> float:
    start = time.perf_counter()
    eng.step()
    return time.perf_counter() - start


def matmul_floor(eng, batch: int) -> float:
    return roofline.time_step_matmuls(roofline.linear_ops(eng.runner.model), batch, repeats=3)


@contextlib.contextmanager
def attention_skipped(eng):
    """The current path with attention replaced by zeros: what the rest of the step costs."""
    backend = eng.runner.attention
    backend.forward = lambda q, *args, **kw: torch.zeros_like(q)  # over the method, on this object
    try:
        yield
    finally:
        del backend.forward


@contextlib.contextmanager
def attention_on(eng, name: str):
    """The current model code with attention on `name` (kernels/attention.py's backends)."""
    from inferline.kernels.attention import make_attention

    runner = eng.runner
    saved = runner.backends, runner.attention
    runner.backends = dataclasses.replace(saved[0], attention=name)
    runner.attention = make_attention(name, runner.block_size, runner.config.num_key_value_heads)
    try:
        yield
    finally:
        runner.backends, runner.attention = saved


@contextlib.contextmanager
def linears_on(eng, packed: list | None):
    """The current path with the linear layers on `packed` (one copy per Linear module in
    model.modules() order, then the LM head's; None: F.linear everywhere), restored after."""
    from inferline.worker.engine.models.linear import Linear

    model = eng.runner.model
    modules = [m for m in model.modules() if isinstance(m, Linear)]
    packed = packed or [None] * (len(modules) + 1)
    saved = [m.packed for m in modules] + [model.lm_head_packed]
    for m, p in zip(modules, packed):
        m.packed = p
    model.lm_head_packed = packed[-1]
    try:
        yield
    finally:
        for m, p in zip(modules, saved):
            m.packed = p
        model.lm_head_packed = saved[-1]


def linears_unpacked(eng):
    """The current path with the linear layers on F.linear (MKL) instead of the packed weights
    (models/linear.py)."""
    return linears_on(eng, None)


def linears_packed_for(eng, backend: str):
    """The current path with the linear layers on `backend`'s packed weights (c: kernels/cpu/gemm.py,
    onednn), whichever the runner chose; the copies are made at first use and kept."""
    from inferline.worker.engine.models.linear import Linear

    copies = eng.runner.__dict__.setdefault("_bench_packed", {})
    if backend not in copies:
        model = eng.runner.model
        weights = [m.weight for m in model.modules() if isinstance(m, Linear)] + [model.lm_head_weight()]
        copies[backend] = [roofline.pack_for(w, backend) for w in weights]  # "c+codes" too
    return linears_on(eng, copies[backend])


@contextlib.contextmanager
def ops_unfused(eng):
    """The current path with RMSNorm, SiLU-and-mul and rope + K/V store as PyTorch ops instead of
    the C kernels of kernels/fused.py."""
    saved = eng.runner.backends
    eng.runner.backends = dataclasses.replace(saved, fused_ops="torch")  # read by prepare() every step
    try:
        yield
    finally:
        eng.runner.backends = saved


@contextlib.contextmanager
def kv_fp16(eng):
    """The current path over an fp16 copy of the K/V cache (INFERLINE_CACHE__DTYPE=float16),
    made at first use. Each variant's steps write their tokens' K/V into their own cache only, so
    the two drift apart in those rows: the timing is the same, the sampled tokens are not checked."""
    from inferline.worker.engine.model_runner import huge_page_tensor

    runner = eng.runner
    if not hasattr(runner, "_bench_kv_fp16"):
        first = runner.kv_cache[0][0]
        whole = torch.Size((len(runner.kv_cache), 2, *first.shape))
        half = huge_page_tensor(tuple(whole), torch.float16)
        for i, (k, v) in enumerate(runner.kv_cache):
            half[i, 0].copy_(k)
            half[i, 1].copy_(v)
        runner._bench_kv_fp16 = [(half[i, 0], half[i, 1]) for i in range(whole[0])]
    saved = runner.kv_cache
    runner.kv_cache = runner._bench_kv_fp16
    try:
        yield
    finally:
        runner.kv_cache = saved


VARIANTS = {
    "v0": v0_patched,
    "torch": lambda eng: attention_on(eng, "torch"),
    "cpu": lambda eng: attention_on(eng, "cpu"),
    "mkl": linears_unpacked,
    "unfused": ops_unfused,
    "no-attn": attention_skipped,
    "cpu-fp16": kv_fp16,
    "c-gemm": lambda eng: linears_packed_for(eng, "c"),
    "c-codes": lambda eng: linears_packed_for(eng, "c+codes"),
    "onednn": lambda eng: linears_packed_for(eng, "onednn"),
}


def measure(args) -> dict:
    eng = build_engine(args)
    lens = [s.num_computed_tokens + 1 for s in eng.scheduler.running]
    names = ["v0", "torch", "cpu", "mkl", "unfused", "no-attn"] if args.compare else [eng.runner.backends.attention]
    if args.kv_fp16:
        names = ["cpu", "cpu-fp16"]
    if args.linears:
        names = ["c-codes", "c-gemm", "onednn", "mkl"]
    res = {"lens": lens, "floor": [matmul_floor(eng, args.batch)], "steps": {name: [] for name in names}}
    for r in range(args.steps):
        for name in names if r % 2 == 0 else names[::-1]:  # ABCD DCBA ...: drifts cancel
            with VARIANTS[name](eng):
                res["steps"][name].append(timed_step(eng))
        if r % 4 == 3:
            res["floor"].append(matmul_floor(eng, args.batch))
    if args.profile:
        res["profile"] = profile_steps(eng, args.profile_steps)
    return res


def profile_steps(eng, num_steps: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            eng.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10)


# ---- main -----------------------------------------------------------------------------------------


def report(args, res: dict) -> None:
    lens, batch = res["lens"], args.batch
    print(f"batch {batch}, contexts {min(lens)}-{max(lens)} (mean {statistics.fmean(lens):.0f}), "
          f"{torch.get_num_threads()} threads, {args.steps} timed steps per variant")
    floor = statistics.median(res["floor"]) * 1e3
    med = {name: statistics.median(ts) * 1e3 for name, ts in res["steps"].items()}
    for name, ts in res["steps"].items():
        print(f"  {name:<8}{med[name]:7.1f} ms/step median (min {min(ts) * 1e3:6.1f}), "
              f"{batch / med[name] * 1e3:6.1f} tok/s; matmul floor = {floor / med[name]:.0%} of it")
    print(f"  matmul floor (bench/roofline.py, this batch): {floor:.1f} ms (median of {len(res['floor'])}), "
          f"{batch / floor * 1e3:.0f} tok/s")
    if "no-attn" in med:
        lo = {name: min(ts) for name, ts in res["steps"].items()}
        for a, b in (("v0", "torch"), ("torch", "cpu"), ("mkl", "cpu"), ("unfused", "cpu")):
            print(f"  {a} / {b}: {med[a] / med[b]:.2f}x (medians), {lo[a] / lo[b]:.2f}x (minima)")
        cost = ", ".join(f"{name} ~{med[name] - med['no-attn']:.0f} ms" for name in ("v0", "torch", "cpu"))
        print(f"  decode attention per step (step minus no-attn): {cost} (v0 also has the old rope/norm code)")
    if "c-gemm" in med:
        for other in ("onednn", "mkl"):
            print(f"  {other} / c-gemm: {med[other] / med['c-gemm']:.2f}x (medians)")
        print(f"  c-gemm / c-codes: {med['c-gemm'] / med['c-codes']:.2f}x (medians)")
    if "cpu-fp16" in med:
        print(f"  cpu / cpu-fp16: {med['cpu'] / med['cpu-fp16']:.2f}x (medians), "
              f"{min(res['steps']['cpu']) / min(res['steps']['cpu-fp16']):.2f}x (minima)")
    if "profile" in res:
        print(f"\ntorch.profiler, {args.profile_steps} steps of the current path, top 10 by self CPU time:")
        print(res["profile"])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.decode_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32, help="decoding sequences per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--extra-context", type=int, default=120, help="tokens added to each prompt")
    p.add_argument("--max-prompt", type=int, default=270)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compare", action="store_true",
                   help="time v0 (the decode path before issue #3), torch (reference.py), cpu (the C kernel), "
                        "mkl (cpu on F.linear) and no-attn (decode attention skipped) side by side")
    p.add_argument("--kv-fp16", action="store_true", help="time the fp32 K/V cache against an fp16 copy")
    p.add_argument("--linears", action="store_true", help="time the linear layers' backends: c, onednn, mkl")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    out = {}

    def work():  # OpenMP's thread count is per thread: set it on the thread that steps
        with roofline.torch_threads(args.threads), torch.inference_mode():
            out.update(measure(args))
            out["threads"] = torch.get_num_threads()

    thread = threading.Thread(target=work, name="decode-step")
    thread.start()
    thread.join()
    with roofline.torch_threads(args.threads):
        report(args, out)


if __name__ == "__main__":
    main()
