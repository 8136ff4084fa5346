"""The one prepared GPU check: the kernels' correctness, timings and bandwidth; the engine.

    bench/gpu_check.sh [--quick] [--markdown PATH] [--skip-engine] [--skip-hf] [--cpu-smoke]

1. Correctness of store_kv, decode (one pass and split-KV) and prefill against kernels/reference.py
   on CUDA: fp32/fp16/bf16, head_dim 64..256, block_size 8..128, GQA 1/4/8, NaN in every unused
   slot and output, range checks on; a cache of more than 2^31 elements read at its far end.
2. Decode timings (do_bench medians) at batch 1..256 x context 512..16384, 32/8 heads, head_dim
   128, bf16, blocks of 16 shuffled: Triton against the reference path on the same paged cache and
   SDPA on gathered dense K/V; bandwidth = K+V bytes / time against a device-to-device copy.
   Target: batch 64, context 4096 at >= 70% of copy bandwidth.
3. Prefill timings against SDPA (causal) on dense K/V.
4. The engine (bench/gpu_engine_check.py): load memory, start-up, decode against the bandwidth
   limit with CUDA graphs off, padded eager and on; SmolLM2's greedy tokens against HF's.

Without a CUDA device it says so and exits 0. `--dry-run` prints the plan and the paper limits
(an H200's nominal bandwidth); `--cpu-smoke` runs the script on the CPU under the Triton
interpreter, tiny shapes, numbers that mean nothing. Sized for under 10 minutes on one H200.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from bench.first_contact import median_ms, rel_err

DEV, SMOKE = "cuda", False  # --cpu-smoke: "cpu", True
H200_NOMINAL_GBS = 4800  # HBM3e, the data sheet's figure: the dry run's paper limit
TOL = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-2}
BENCH_HEADS, BENCH_KV_HEADS, BENCH_DIM, BENCH_BLOCK = 32, 8, 128, 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    p.add_argument("--markdown", type=Path, help="also write the tables to this file")
    p.add_argument("--skip-engine", action="store_true", help="no load, engine or HF section")
    p.add_argument("--skip-hf", action="store_true", help="no greedy comparison with HF")
    mode = p.add_mutually_exclusive_group()
    smoke = "this script on the CPU under the Triton interpreter, tiny shapes"
    mode.add_argument("--cpu-smoke", action="store_true", help=smoke)
    mode.add_argument("--dry-run", action="store_true", help="print the plan and the paper limits")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, report, failures = parse_args(argv), Report(), 0
    global DEV, SMOKE
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
        DEV, SMOKE, args.quick = "cpu", True, True
    if args.dry_run:
        dry_run(report, args)
    elif DEV == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU (torch.cuda.is_available() is False); nothing measured.")
        return 0
    else:
        failures = run(report, args)
    if args.markdown:
        args.markdown.write_text(report.text())
    return 1 if failures else 0


def run(report: Report, args) -> int:
    import triton

    smoke = "CPU smoke run (numbers mean nothing)"
    device = torch.cuda.get_device_name() if DEV == "cuda" else smoke
    report.line(f"# GPU check: {device}, torch {torch.__version__}, triton {triton.__version__}")
    started = time.perf_counter()
    failures = check_correctness(report, quick=args.quick)
    copy_gbs = measure_copy_bandwidth(report)
    bench_decode(report, copy_gbs, quick=args.quick)
    bench_prefill(report, quick=args.quick)
    report.line(f"\nkernel sections: {time.perf_counter() - started:.0f} s")
    if not args.skip_engine:
        failures += run_engine_sections(report, copy_gbs, args)
    report.line(f"\ntotal {time.perf_counter() - started:.0f} s; correctness failures: {failures}")
    return failures


def run_engine_sections(report: "Report", copy_gbs: float, args) -> int:
    from bench import gpu_engine_check as engine

    os.environ["INFERLINE_KERNEL_CHECKS"] = "0"  # range checks sync: none inside a graph capture
    started = time.perf_counter()
    failures = guarded(report, "load", engine.bench_load, report, DEV, SMOKE)
    failures += guarded(report, "engine", engine.bench_engine, report, copy_gbs, DEV, SMOKE)
    if not args.skip_hf:
        failures += guarded(report, "HF greedy", engine.check_hf_greedy, report, DEV, SMOKE)
    report.line(f"\nengine sections: {time.perf_counter() - started:.0f} s")
    return failures


def guarded(report: "Report", name: str, section, *args) -> int:
    """A section's failures; one that raises is reported as one and the run goes on, so the
    tables of the others (and --markdown) still come out."""
    try:
        return section(*args) or 0
    except Exception as e:
        report.line(f"\n**{name} section failed**: {type(e).__name__}: {str(e)[:300]}")
        return 1


def dry_run(report: "Report", args) -> None:
    """What a run would do, and the engine's paper limits at an H200's nominal bandwidth."""
    from bench import gpu_engine_check as engine

    report.line("# GPU check: dry run (nothing launched)")
    batches, contexts = decode_shapes(args.quick)
    report.line(
        f"\n1. correctness: store_kv, decode (1 pass, split, 7 splits), prefill; fp32/fp16/bf16; "
        f"{3 if args.quick else 7} (gqa, block, head_dim) combos; int64 addressing\n"
        f"2. decode attention: batches {list(batches)} x contexts {list(contexts)}, against the "
        "copy bandwidth\n3. prefill attention against SDPA"
    )
    if args.skip_engine:
        return
    report.line(
        f"4. load: {engine.ENGINE_PRESET} dummy weights; engine start-up; decode at batches "
        f"{list(engine.ENGINE_BATCHES)}, context {engine.ENGINE_CONTEXT}, modes "
        f"{list(engine.MODES)}"
    )
    if not args.skip_hf:
        prompts = f"{engine.HF_PROMPTS} prompts x {engine.HF_NEW_TOKENS} tokens"
        report.line(f"5. HF greedy: SmolLM2 fp32, {prompts}, graphs on and off")
    gbs = f"{H200_NOMINAL_GBS} GB/s (H200 nominal)"
    report.line(f"\n## Paper limit: {engine.ENGINE_PRESET} decode at {gbs}\n")
    report.table(engine.LIMIT_HEADER, engine.limit_rows(H200_NOMINAL_GBS))


def decode_shapes(quick: bool) -> tuple[tuple, tuple]:
    """(batches, contexts) of the decode timings."""
    return ((1, 64), (4096,)) if quick else ((1, 16, 64, 256), (512, 2048, 4096, 16384))


class Report:
    def __init__(self):
        self.lines: list[str] = []

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def table(self, header: list[str], rows: list[list]) -> None:
        self.line("| " + " | ".join(header) + " |")
        self.line("|" + "---|" * len(header))
        for row in rows:
            self.line("| " + " | ".join(str(c) for c in row) + " |")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


# --- paged cache construction ---------------------------------------------------------------


def paged_cache(
    lens, block_size, num_kv_heads, head_dim, dtype, *, poison=True, spare=4, offset_blocks=0
):
    """Random tokens for each sequence at shuffled blocks; NaN elsewhere (when poison)."""
    dev, per_seq = DEV, [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + spare + offset_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    fill = float("nan") if poison else 0.0
    k_cache, v_cache = (torch.full(shape, fill, dtype=dtype, device=dev) for _ in range(2))
    # past each sequence's blocks: garbage padding
    tables = torch.full((len(lens), max(per_seq) + 1), 1 << 30, dtype=torch.int32, device=dev)
    order = torch.randperm(num_blocks - offset_blocks, device=dev).int() + offset_blocks
    start = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[start : start + n]
        start += n
    for i, n in enumerate(lens):
        pos = torch.arange(n, device=dev)
        slots = tables[i, pos // block_size].long() * block_size + pos % block_size
        for cache in (k_cache, v_cache):
            values = torch.randn(n, num_kv_heads, head_dim, device=dev).to(dtype)
            cache.view(-1, num_kv_heads, head_dim)[slots] = values
    return k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device=dev)


def bench(fn, warmup=25, rep=100) -> float:
    return median_ms(DEV, fn, warmup, rep)


def _empty_cache() -> None:
    if DEV == "cuda":
        torch.cuda.empty_cache()


def free_memory() -> int:
    return torch.cuda.mem_get_info()[0] if DEV == "cuda" else 1 << 34


# --- 1. correctness -----------------------------------------------------------------------------


def check_correctness(report: Report, quick: bool) -> int:
    from inferline.kernels import reference
    from inferline.kernels.triton.decode import paged_decode_attention_triton
    from inferline.kernels.triton.prefill import paged_prefill_attention_triton

    os.environ["INFERLINE_KERNEL_CHECKS"] = "1"  # launchers check index ranges (syncs; fine here)
    torch.manual_seed(0)
    rows, failures = [], 0
    # (gqa, block_size, head_dim)
    combos = [(1, 8, 64), (4, 16, 128), (8, 32, 80), (4, 64, 96), (8, 128, 256), (4, 16, 256)]
    combos = combos[:3] if quick else [*combos, (1, 128, 128)]
    for dtype in TOL:
        for gqa, bs, dim in combos:
            kvh = 2
            lens = [1, bs - 1, bs + 1, 70, 130] if SMOKE else [1, bs - 1, bs + 1, 700, 3000]
            k_cache, v_cache, tables, ctx = paged_cache(lens, bs, kvh, dim, dtype)
            q = torch.randn(len(lens), kvh * gqa, dim, device=DEV).to(dtype)
            args = (q, k_cache, v_cache, tables, ctx, dim**-0.5)
            ref = reference.paged_decode_attention(*args)
            for label, n in (("decode 1-pass", 1), ("decode split", None), ("decode 7 splits", 7)):
                out = torch.full_like(q, float("nan"))
                paged_decode_attention_triton(*args, out=out, **({"num_splits": n} if n else {}))
                failures += _row(rows, label, dtype, gqa, bs, dim, rel_err(out, ref))
            cache = (k_cache, v_cache, tables, ctx)
            failures += _check_prefill(rows, paged_prefill_attention_triton, dtype, gqa, bs, *cache)
        failures += _check_store(rows, dtype)
    if not SMOKE:
        failures += _check_int64(rows)
    report.line("\n## Correctness (relative norm error vs kernels/reference.py on CUDA)\n")
    report.table(["kernel", "dtype", "gqa", "block", "head_dim", "rel err", "tol", "ok"], rows)
    os.environ["INFERLINE_KERNEL_CHECKS"] = "0"
    return failures


def _row(rows, label, dtype, gqa, bs, dim, err) -> int:
    """A correctness row; 1 when `err` is over the dtype's tolerance (or NaN), else 0."""
    tol = TOL[dtype]
    ok = err <= tol  # NaN compares False
    verdict = "ok" if ok else "**FAIL**"
    rows.append([label, str(dtype)[6:], gqa, bs, dim, f"{err:.2e}", f"{tol:.0e}", verdict])
    return 0 if ok else 1


def _check_prefill(rows, prefill, dtype, gqa, bs, k_cache, v_cache, tables, ctx) -> int:
    from inferline.kernels import reference

    dim = k_cache.shape[-1]
    q_lens = [1, bs - 1, 2, 70, 33] if SMOKE else [1, bs - 1, 2, 700, 333]  # on cached context
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEV)
    q = torch.randn(int(cu[-1]), k_cache.shape[2] * gqa, dim, device=DEV).to(dtype)
    args = (q, k_cache, v_cache, tables, cu, ctx, dim**-0.5)
    ref = reference.paged_prefill_attention(*args)
    out = torch.full_like(q, float("nan"))
    prefill(*args, out=out)
    return _row(rows, "prefill", dtype, gqa, bs, dim, rel_err(out, ref))


def _check_store(rows, dtype) -> int:
    from inferline.kernels import reference
    from inferline.kernels.triton.store import store_kv_triton

    shape = (64, 16, 8, 128)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    v_cache, want_k, want_v = k_cache.clone(), k_cache.clone(), k_cache.clone()
    slots = torch.randperm(64 * 16, device=DEV)[:500]
    slots[::7] = -1
    k = torch.randn(500, 8, 128, device=DEV).to(dtype)
    v = torch.randn(500, 8, 128, device=DEV).to(dtype)
    store_kv_triton(k, v, k_cache, v_cache, slots)
    reference.store_kv(k, v, want_k, want_v, slots)
    same = all(
        torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
        for got, want in ((k_cache, want_k), (v_cache, want_v))
    )
    return _row(rows, "store_kv (exact)", dtype, "-", 16, 128, 0.0 if same else float("inf"))


def _check_int64(rows) -> int:
    """A bf16 cache of > 2^31 elements; the sequence's blocks sit at its far end."""
    from inferline.kernels import reference
    from inferline.kernels.triton.decode import paged_decode_attention_triton
    from inferline.kernels.triton.prefill import paged_prefill_attention_triton
    from inferline.kernels.triton.store import store_kv_triton

    bs, kvh, dim = 16, 8, 128
    per_block = bs * kvh * dim
    offset_blocks = (1 << 31) // per_block + 64  # the first 2^31 elements are never touched
    free = free_memory()
    if 2 * 2 * (offset_blocks + 128) * per_block > free * 0.8:
        rows.append(["int64 addressing", "bf16", "-", bs, dim, "skipped: memory", "-", "-"])
        return 0
    k_cache, v_cache, tables, ctx = paged_cache(
        [1000, 37], bs, kvh, dim, torch.bfloat16, poison=False, offset_blocks=offset_blocks
    )
    q = torch.randn(2, 32, dim, device=DEV).to(torch.bfloat16)
    new = torch.randn(2, kvh, dim, device=DEV).to(torch.bfloat16)
    last = tables[:, 0].long() * bs  # overwrite token 0 of each sequence through the kernel
    store_kv_triton(new, new, k_cache, v_cache, last)
    err = rel_err(k_cache.view(-1, kvh, dim)[last], new)
    failures = _row(rows, "int64 store", torch.bfloat16, "-", bs, dim, err)
    args = (q, k_cache, v_cache, tables, ctx, dim**-0.5)
    err = rel_err(paged_decode_attention_triton(*args), reference.paged_decode_attention(*args))
    failures += _row(rows, "int64 decode", torch.bfloat16, 4, bs, dim, err)
    cu = torch.tensor([0, 100, 137], dtype=torch.int32, device=DEV)
    qp = torch.randn(137, 32, dim, device=DEV).to(torch.bfloat16)
    args = (qp, k_cache, v_cache, tables, cu, ctx, dim**-0.5)
    err = rel_err(paged_prefill_attention_triton(*args), reference.paged_prefill_attention(*args))
    failures += _row(rows, "int64 prefill", torch.bfloat16, 4, bs, dim, err)
    del k_cache, v_cache
    _empty_cache()
    return failures


# --- 2. decode timings and bandwidth ---------------------------------------------------------


def measure_copy_bandwidth(report: Report) -> float:
    size = 1 << (26 if SMOKE else 30)  # 1 GiB: well past L2
    buffers = [torch.empty(size, dtype=torch.uint8, device=DEV) for _ in range(2)]
    ms = bench(lambda: buffers[1].copy_(buffers[0]), warmup=50, rep=300)
    gbs = 2 * size / ms / 1e6  # read + write
    copy = f"device-to-device copy of {size >> 20} MiB: {ms:.3f} ms, {gbs:.0f} GB/s"
    report.line(f"\n## Bandwidth\n\n{copy}")
    buffers.clear()
    _empty_cache()
    return gbs


def bench_decode(report: Report, copy_gbs: float, quick: bool) -> None:
    batches, contexts = ((1, 2), (64,)) if SMOKE else decode_shapes(quick)
    rows = []
    for ctx_len in contexts:
        for batch in batches:
            rows.append(_decode_row(batch, ctx_len, copy_gbs))
            _empty_cache()  # the row's tensors died with its frame
    report.line(
        f"\n## Decode attention, bf16, {BENCH_HEADS}/{BENCH_KV_HEADS} heads, head_dim {BENCH_DIM}, "
        f"block {BENCH_BLOCK}\n\nms = do_bench median; speed-up = other / triton; "
        "bandwidth = K+V bytes / triton time.\n"
    )
    header = ["batch", "context", "triton ms", "reference ms", "SDPA dense ms", "vs ref", "vs SDPA"]
    report.table(header + ["GB/s", "of copy"], rows)
    target = [r for r in rows if r[0] == 64 and r[1] == 4096]
    if target:
        report.line(f"\ntarget (batch 64, context 4096, >= 70% of copy bandwidth): {target[0][-1]}")


def _decode_row(batch: int, ctx_len: int, copy_gbs: float) -> list:
    import torch.nn.functional as F

    from inferline.kernels import reference
    from inferline.kernels.triton.decode import paged_decode_attention_triton

    k_cache, v_cache, tables, ctx = _bench_cache([ctx_len] * batch)
    q = torch.randn(batch, BENCH_HEADS, BENCH_DIM, device=DEV).to(torch.bfloat16)
    args = (q, k_cache, v_cache, tables, ctx, BENCH_DIM**-0.5)
    kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
    t_triton = bench(lambda: paged_decode_attention_triton(*args))
    t_ref = "-"
    if kv_bytes <= (2 << 30):  # the reference gathers in fp32: skip the largest shapes
        t_ref = bench(lambda: reference.paged_decode_attention(*args), warmup=5, rep=50)
    t_sdpa = "-"
    if 2 * kv_bytes < free_memory() * 0.7:
        dense = (q.unsqueeze(2), *_dense_kv(k_cache, v_cache, tables, ctx_len))
        sdpa = F.scaled_dot_product_attention
        t_sdpa = bench(lambda: sdpa(*dense, scale=args[-1], enable_gqa=True))
    gbs = kv_bytes / t_triton / 1e6
    times = [f"{t_triton:.3f}", _fmt(t_ref), _fmt(t_sdpa)]
    ratios = [_ratio(t_ref, t_triton), _ratio(t_sdpa, t_triton)]
    return [batch, ctx_len, *times, *ratios, f"{gbs:.0f}", f"{100 * gbs / copy_gbs:.0f}%"]


def _bench_cache(lens):
    """The timings' cache: bf16, BENCH_* heads and blocks, no NaN poison, no spare blocks."""
    return paged_cache(
        lens, BENCH_BLOCK, BENCH_KV_HEADS, BENCH_DIM, torch.bfloat16, poison=False, spare=0
    )


def _dense_kv(k_cache, v_cache, tables, ctx_len: int):
    """K and V gathered into dense [B, KH, L, D] for SDPA."""
    from inferline.kernels import reference

    return [
        reference.gather_kv(c, tables, ctx_len).transpose(1, 2).contiguous()
        for c in (k_cache, v_cache)
    ]


def _fmt(t) -> str:
    return t if isinstance(t, str) else f"{t:.3f}"


def _ratio(other, mine) -> str:
    return "-" if isinstance(other, str) else f"{other / mine:.2f}x"


def bench_prefill(report: Report, quick: bool) -> None:
    shapes = ((1, 2048, 2048),) if quick else ((1, 4096, 4096), (8, 512, 2048))
    shapes = ((1, 64, 64), (2, 16, 64)) if SMOKE else shapes
    rows = []
    for shape in shapes:
        rows.append(_prefill_row(*shape))
        _empty_cache()
    report.line("\n## Prefill attention, bf16 (SDPA on dense K/V, gather not timed)\n")
    head = ["batch", "q_len", "context", "triton ms", "SDPA ms", "vs SDPA", "TFLOP/s (causal)"]
    report.table(head, rows)


def _prefill_row(batch: int, q_len: int, ctx_len: int) -> list:
    import torch.nn.functional as F

    from inferline.kernels import reference
    from inferline.kernels.triton.prefill import paged_prefill_attention_triton

    k_cache, v_cache, tables, ctx = _bench_cache([ctx_len] * batch)
    cu = torch.arange(batch + 1, device=DEV, dtype=torch.int32) * q_len
    q = torch.randn(batch * q_len, BENCH_HEADS, BENCH_DIM, device=DEV).to(torch.bfloat16)
    args = (q, k_cache, v_cache, tables, cu, ctx, BENCH_DIM**-0.5)
    t_triton = bench(lambda: paged_prefill_attention_triton(*args))
    k, v = _dense_kv(k_cache, v_cache, tables, ctx_len)
    qd = q.view(batch, q_len, BENCH_HEADS, BENCH_DIM).transpose(1, 2)
    # bottom-right causal: query rows are the last q_len positions
    pos = torch.arange(ctx_len - q_len, ctx_len, device=DEV)[:, None]
    mask = None if q_len == ctx_len else torch.arange(ctx_len, device=DEV)[None, :] <= pos
    sdpa_kw = dict(is_causal=mask is None, attn_mask=mask, scale=args[-1], enable_gqa=True)
    t_sdpa = bench(lambda: F.scaled_dot_product_attention(qd, k, v, **sdpa_kw))
    flops = 4 * batch * BENCH_HEADS * BENCH_DIM * (q_len * ctx_len - q_len * (q_len - 1) / 2)
    times = [f"{t_triton:.3f}", f"{t_sdpa:.3f}", _ratio(t_sdpa, t_triton)]
    return [batch, q_len, ctx_len, *times, f"{flops / t_triton / 1e9:.0f}"]


if __name__ == "__main__":
    sys.exit(main())
