"""Decode-step micro-benchmark: ms per step of the real engine (SmolLM2) at a fixed batch of
decodes, and the step's host preparation alone.

    python -m bench.decode_step                  # batch 32, 20 timed steps, 2 threads
    python -m bench.decode_step --compare        # torch, cpu, mkl, unfused and no-attn side by side
    python -m bench.decode_step --linears        # the linear backends in whole steps
    python -m bench.decode_step --prep           # the step's host preparation alone

Steps: `--batch` requests of the engine benchmark's prompts plus `--extra-context` tokens each,
prefilled; then whole `LLMEngine.step()` calls, one token per sequence, on a thread of their own.
Variants alternate step by step (ABCD DCBA) on one batch: decode attention in PyTorch (`torch`)
or the C kernel (`cpu`); the linear layers on F.linear (`mkl`), the C GEMM over 8-bit codes
(`c-codes`) or fp32 panels (`c-gemm`), or oneDNN (`onednn`); norms, SiLU and rope as PyTorch ops
(`unfused`); attention skipped (`no-attn`: what the rest costs). The matmul floor (the step's
linear layers alone) is timed in between. --prep: StepBuilder's batch tensors and the C
kernel's attention metadata for `--seqs` decodes, a new block every 16 steps, in microseconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import statistics
import time

import torch

from bench import roofline, stats
from bench.engine import engine_settings
from bench.workload import make_workload

BLOCK = 16  # --prep's block size


def build_engine(args):
    from inferline.worker.engine.engine import LLMEngine
    from inferline.worker.engine.model_runner import ModelRunner
    from inferline.worker.engine.request import EngineRequest, SamplingParams

    settings = engine_settings("continuous", args.batch, 512)
    runner = ModelRunner(settings)
    eng = LLMEngine(runner, settings)
    params = SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True)  # nobody finishes
    for item in make_workload(runner.tokenizer, args.batch, seed=args.seed):
        prompt = item.prompt_token_ids + (item.prompt_token_ids * 8)[: args.extra_context]
        eng.add_request(EngineRequest(item.request_id, sampling=params, prompt_token_ids=prompt))
    while True:  # prefill everyone
        eng.step()
        st = eng.stats()
        if st.num_waiting == 0 and st.num_batched_tokens == st.batch_size == args.batch:
            break
        assert eng.has_unfinished_requests() and st.num_preemptions == 0, "the batch did not form"
    for _ in range(args.warmup):
        eng.step()
    return eng


@contextlib.contextmanager
def swapped(obj, name: str, value):
    """`obj.name = value` for the block, restored after."""
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


@contextlib.contextmanager
def attention_skipped(eng):
    """The step with attention replaced by zeros: what the rest of it costs."""
    backend = eng.runner.attention
    backend.forward = lambda q, *args, **kw: torch.zeros_like(q)  # over the method, on this object
    try:
        yield
    finally:
        del backend.forward


@contextlib.contextmanager
def attention_on(eng, name: str):
    """The model with decode attention on `name` (kernels/attention.py's backends)."""
    from inferline.kernels.attention import make_attention

    runner = eng.runner
    a = runner.attention
    new = make_attention(name, a.block_size, a.num_kv_heads, a.head_dim)
    with (
        swapped(runner, "backends", dataclasses.replace(runner.backends, attention=name)),
        swapped(runner, "attention", new),
    ):
        yield


@contextlib.contextmanager
def linears_on(eng, backend: str | None):
    """The linear layers on `backend`'s packed copies (None: F.linear everywhere), packed at first
    use and kept; the model's own copies restored after."""
    from inferline.worker.engine.models.linear import Linear

    model = eng.runner.model
    modules = [m for m in model.modules() if isinstance(m, Linear)]
    weights = [m.weight for m in modules] + [model.lm_head_weight()]
    copies = eng.runner.__dict__.setdefault("_bench_packed", {})
    if backend not in copies:
        copies[backend] = [backend and roofline.pack_for(w, backend) for w in weights]
    saved = [m.packed for m in modules] + [model.lm_head_packed]
    for m, p in zip(modules, copies[backend]):
        m.packed = p
    model.lm_head_packed = copies[backend][-1]
    try:
        yield
    finally:
        for m, p in zip(modules, saved):
            m.packed = p
        model.lm_head_packed = saved[-1]


VARIANTS = {
    "torch": lambda eng: attention_on(eng, "torch"),
    "cpu": lambda eng: attention_on(eng, "cpu"),
    "mkl": lambda eng: linears_on(eng, None),
    # the backends are read by prepare() every step
    "unfused": lambda eng: swapped(
        eng.runner, "backends", dataclasses.replace(eng.runner.backends, fused_ops="torch")
    ),
    "no-attn": attention_skipped,
    "c-gemm": lambda eng: linears_on(eng, "c"),
    "c-codes": lambda eng: linears_on(eng, "c+codes"),
    "onednn": lambda eng: linears_on(eng, "onednn"),
}


def measure_steps(args) -> dict:
    eng = build_engine(args)
    names = [eng.runner.backends.attention]
    names = ["c-codes", "c-gemm", "onednn", "mkl"] if args.linears else names
    names = ["torch", "cpu", "mkl", "unfused", "no-attn"] if args.compare else names
    ops = roofline.linear_ops(eng.runner.model)
    lens = [s.num_computed_tokens + 1 for s in eng.scheduler.running]
    res = {"lens": lens, "floor": [], "steps": {name: [] for name in names}}
    for i, name in enumerate(stats.abba(names, args.steps)):
        if i % (4 * len(names)) == 0:
            res["floor"].append(roofline.time_step_matmuls(ops, args.batch, repeats=3))
        with VARIANTS[name](eng):
            start = time.perf_counter()
            eng.step()
            res["steps"][name].append(time.perf_counter() - start)
    return res


def report_steps(args, res: dict) -> None:
    lens, batch = res["lens"], args.batch
    threads, steps = torch.get_num_threads(), args.steps
    print(
        f"batch {batch}, contexts {min(lens)}-{max(lens)}, {threads} threads, {steps} timed steps"
    )
    floor = statistics.median(res["floor"]) * 1e3
    med = {name: statistics.median(ts) * 1e3 for name, ts in res["steps"].items()}
    for name, ts in res["steps"].items():
        print(
            f"  {name:<8}{med[name]:7.1f} ms/step median (min {min(ts) * 1e3:6.1f}), "
            f"{batch / med[name] * 1e3:6.1f} tok/s; matmul floor = {floor / med[name]:.0%} of it"
        )
    print(f"  matmul floor (this batch): {floor:.1f} ms, {batch / floor * 1e3:.0f} tok/s")
    pairs = ("torch", "cpu"), ("mkl", "cpu"), ("unfused", "cpu"), ("onednn", "c-gemm")
    for a, b in [*pairs, ("mkl", "c-gemm"), ("c-gemm", "c-codes")]:
        if a in med and b in med:
            print(f"  {a} / {b}: {med[a] / med[b]:.2f}x (medians)")
    if "no-attn" in med:
        print(
            "  decode attention per step (step minus no-attn): "
            + ", ".join(f"{n} ~{med[n] - med['no-attn']:.0f} ms" for n in ("torch", "cpu"))
        )


# ---- the step's host preparation alone --------------------------------------------------------


def make_batch(num_seqs: int, context: int, seed: int = 0) -> list:
    """Decodes at about `context` tokens (a little spread), block tables of distinct random ids."""
    from inferline.worker.engine.request import SamplingParams
    from inferline.worker.engine.scheduler import ScheduledSequence
    from inferline.worker.engine.sequence import Sequence

    rng = random.Random(seed)
    lengths = [context - rng.randrange(0, BLOCK * 2) for _ in range(num_seqs)]
    pool = list(range(sum(-(-n // BLOCK) + 64 for n in lengths)))
    rng.shuffle(pool)
    batch = []
    for i, n in enumerate(lengths):
        prompt = [rng.randrange(1000) for _ in range(n - 8)]
        seq = Sequence(f"s{i}", prompt, SamplingParams(max_tokens=10**6))
        seq.output_token_ids = [rng.randrange(1000) for _ in range(8)]
        seq.num_computed_tokens = n - 1
        seq.block_table = [pool.pop() for _ in range(-(-n // BLOCK))]
        batch.append(ScheduledSequence(seq, 1))
    return batch


def advance(batch: list, fresh_block) -> None:
    """What the engine does after a decode step: a token appended, a block where one fills."""
    for s in batch:
        s.seq.output_token_ids.append(7)
        s.seq.num_computed_tokens += 1
        if s.seq.num_tokens > len(s.seq.block_table) * BLOCK:
            s.seq.block_table.append(fresh_block())


def measure_prep(args) -> dict:
    """Median microseconds of a step's preparation, per context."""
    from inferline.kernels.attention import CpuAttention
    from inferline.worker.engine.step_inputs import StepBuilder

    out = {}
    for context in args.context:
        batch, fresh = make_batch(args.seqs, context), iter(range(10**7, 2 * 10**7))
        builder = StepBuilder(BLOCK, -(-(context + 4 * args.steps) // BLOCK) + 4, lambda t: t)
        attention, times = CpuAttention(BLOCK, 8), []
        for i in range(5 + args.steps):  # 5 warm-up steps
            start = time.perf_counter()
            attention.prepare(builder.build(batch).tables)
            times += [time.perf_counter() - start] if i >= 5 else []
            advance(batch, fresh.__next__)
        out[context] = statistics.median(times) * 1e6
        median = f"{out[context]:7.0f} us a step (median of {args.steps})"
        print(f"{args.seqs} seqs x {context:>6} context: {median}")
    return out


def parse_args(argv=None):
    p = stats.parser("decode_step", __doc__, threads=2)
    p.add_argument("--batch", type=int, default=32, help="decoding sequences per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps (passes) per variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--extra-context", type=int, default=120, help="tokens added to each prompt")
    p.add_argument("--seed", type=int, default=0)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--compare", action="store_true", help="attention, linears, fused ops")
    mode.add_argument("--linears", action="store_true", help="the linear backends in whole steps")
    mode.add_argument("--prep", action="store_true", help="the step's host preparation alone")
    p.add_argument("--seqs", type=int, default=64, help="--prep: decoding sequences")
    p.add_argument("--context", type=int, nargs="+", default=[2048, 32768], help="--prep")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)

    def work():
        with torch.inference_mode():
            if args.prep:
                return measure_prep(args)
            res = measure_steps(args)
            report_steps(args, res)
            return res

    return roofline.in_thread(work, args.threads)


if __name__ == "__main__":
    main()
