"""Decode attention alone: ms per engine step (every layer once) for the C kernel and the PyTorch path.

    python -m bench.decode_attention                 # batch 32, contexts 173-440, SmolLM2's shapes
    python -m bench.decode_attention --hot           # every table points at 4 blocks: compute only
    python -m bench.decode_attention --skip-torch    # the C kernel over fp32 and over fp16 caches

A step of SmolLM2 at batch 32 reads ~450 MB of K/V, scattered over the cache in blocks of 16
tokens, so the kernel is judged by how close it gets to the machine's memory bandwidth (printed
as GB/s of K/V read); `--hot` maps every sequence onto the same 4 blocks, which stay in cache,
and shows what the arithmetic alone costs. `cpu-fp16` is the C kernel over an fp16 copy of the
cache (INFERLINE_CACHE__DTYPE=float16): half the bytes to read. Variants run interleaved (ABBA)
in one process, on a thread of their own as in the worker; the first call of each is checked
against reference.py over the same cache.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench import roofline
from inferline.kernels import reference
from inferline.kernels.cpu import attention, build


def make_step(args, gen):
    """(caches per layer, q, block_tables, context_lens): one decode step's inputs."""
    blocks, bs = args.num_blocks, args.block_size
    shape = (args.layers, 2, blocks, bs, args.kv_heads, args.head_dim)
    cache = torch.randn(shape, generator=gen)
    lens = torch.randint(args.min_context, args.max_context + 1, (args.batch,), generator=gen, dtype=torch.int32)
    width = -(-int(lens.max()) // bs)
    assert args.batch * width <= blocks, "--num-blocks too small for the batch"
    if args.hot:
        tables = torch.arange(args.batch * width) % 4
    else:  # every block of every sequence somewhere else in the cache, as after many steps
        tables = torch.randperm(blocks, generator=gen)[: args.batch * width]
    tables = tables.view(args.batch, width).to(torch.int32).contiguous()
    q = torch.randn(args.batch, args.heads, args.head_dim, generator=gen)
    return cache, q, tables, lens


def variants(args, cache):
    """name: (attention function, the cache it reads)."""
    out = {"cpu": (attention.paged_decode_attention_cpu, cache)}
    if not args.skip_fp16:
        out["cpu-fp16"] = (attention.paged_decode_attention_cpu, cache.half())
    if not args.skip_torch:
        out["torch"] = (reference.paged_decode_attention, cache)
    return out


def measure(args) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    cache, q, tables, lens = make_step(args, gen)
    scale = args.head_dim ** -0.5
    fns = variants(args, cache)
    for name, (fn, c) in fns.items():
        want = reference.paged_decode_attention(q, c[0, 0], c[0, 1], tables, lens, scale)
        got = fn(q, c[0, 0], c[0, 1], tables, lens, scale)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"{name} differs from reference.py")
    times = {name: [] for name in fns}
    order = list(fns)
    for r in range(args.repeats):
        for name in order if r % 2 == 0 else order[::-1]:
            fn, c = fns[name]
            start = time.perf_counter()
            for layer in range(args.layers):
                fn(q, c[layer, 0], c[layer, 1], tables, lens, scale)
            times[name].append(time.perf_counter() - start)
    tokens = float(lens.sum()) * args.kv_heads * args.head_dim * 2 * args.layers  # K and V elements read
    kv_bytes = {name: tokens * c.dtype.itemsize for name, (_, c) in fns.items()}
    return {"times": times, "kv_bytes": kv_bytes, "lens": lens.tolist(), "threads": torch.get_num_threads()}


def report(args, res: dict) -> None:
    lens = res["lens"]
    print(f"batch {args.batch}, contexts {min(lens)}-{max(lens)}, {args.layers} layers, "
          f"{res['kv_bytes']['cpu'] / 1e6:.0f} MB of fp32 K/V per step{' (hot: 4 blocks)' if args.hot else ''}, "
          f"{res['threads']} threads, {args.repeats} steps per variant")
    for name, ts in res["times"].items():
        med = statistics.median(ts)
        print(f"  {name:<8} {med * 1e3:7.1f} ms/step median (min {min(ts) * 1e3:6.1f}), "
              f"{res['kv_bytes'][name] / med / 1e9:5.1f} GB/s of K/V")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.decode_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--min-context", type=int, default=173)
    p.add_argument("--max-context", type=int, default=440)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=1356, help="cache size (the engine's default on 1 GB)")
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hot", action="store_true", help="tables point at 4 blocks: no memory traffic")
    p.add_argument("--skip-torch", action="store_true", help="leave out the PyTorch path")
    p.add_argument("--skip-fp16", action="store_true", help="leave out the C kernel over an fp16 cache")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not build.available():
        raise SystemExit("the C kernel could not be built here (no C compiler?): nothing to measure")
    res = roofline.in_thread(lambda: measure(args), args.threads)
    report(args, res)
    return res


if __name__ == "__main__":
    main()
