"""Prompt attention alone on the CPU: one prompt chunk's rows, a row at a time vs in tiles.

    python -m bench.prompt_attention                       # prompts of 256, 1024, 2048 and 4096 tokens
    python -m bench.prompt_attention --lens 512 --layers 30

The engine attends a prompt chunk's rows with the C decode kernel, each row over its own causal
context (ModelRunner._token_tables). Given cu_seqlens, the kernel takes a sequence's rows 16 at
a time: each block's K/V read once per tile (a 4k-token prompt's K/V outgrow L2) and scores
computed 16 tokens a vector from the block's K transposed. `rows` is the call without
cu_seqlens (a table per row: every row alone, the path before tiles); `tiles` the engine's
call; `torch` the PyTorch prefill path (reference.py, SDPA over a gathered copy). Variants run
alternated in one process on a thread of their own; tiles must equal rows bit for bit.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench import roofline
from inferline.kernels import reference
from inferline.kernels.cpu import attention, build


def make_prompt(args, n: int, gen):
    """Per layer (k, v caches), and q, cu_seqlens, per-row contexts, the sequence's table, per-row tables."""
    bs = args.block_size
    blocks = -(-n // bs) + 1
    caches = [(torch.randn(blocks, bs, args.kv_heads, args.head_dim, generator=gen),
               torch.randn(blocks, bs, args.kv_heads, args.head_dim, generator=gen)) for _ in range(args.layers)]
    table = torch.randperm(blocks, generator=gen)[: -(-n // bs)].to(torch.int32).view(1, -1)
    q = torch.randn(n, args.heads, args.head_dim, generator=gen)
    ctx = torch.arange(1, n + 1, dtype=torch.int32)
    return caches, q, torch.tensor([0, n], dtype=torch.int32), ctx, table, table.expand(n, -1).contiguous()


def variants(args, n: int, gen) -> dict:
    caches, q, cu, ctx, table, row_tables = make_prompt(args, n, gen)
    scale = args.head_dim ** -0.5

    def rows():
        return [attention.paged_decode_attention_cpu(q, k, v, row_tables, ctx, scale) for k, v in caches]

    def tiles():
        return [attention.paged_decode_attention_cpu(q, k, v, table, ctx, scale, cu) for k, v in caches]

    def torch_path():
        lens = torch.tensor([n], dtype=torch.int32)
        return [reference.paged_prefill_attention(q, k, v, table, cu, lens, scale) for k, v in caches]

    fns = {"rows": rows, "tiles": tiles}
    if not args.skip_torch:
        fns["torch"] = torch_path
    first = {name: fn()[0] for name, fn in fns.items()}
    assert torch.equal(first["tiles"], first["rows"]), "tiles differ from rows a row at a time"
    if "torch" in first:
        err = float((first["tiles"] - first["torch"]).norm() / first["torch"].norm())
        assert err < 1e-5, f"tiles differ from the PyTorch prefill: relative error {err:.2e}"
    return fns


def measure(args) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    res = {}
    for n in args.lens:
        fns = variants(args, n, gen)
        times = {name: [] for name in fns}
        for r in range(args.repeats):
            for name in list(fns) if r % 2 == 0 else list(fns)[::-1]:
                start = time.perf_counter()
                fns[name]()
                times[name].append(time.perf_counter() - start)
        res[n] = {name: statistics.median(ts) / args.layers for name, ts in times.items()}
    return res


def report(args, res: dict) -> None:
    flop = lambda n: n * (n + 1) / 2 * args.heads * args.head_dim * 4  # QK and PV, causal  # noqa: E731
    print(f"prompt attention, one layer (median of {args.repeats}, {args.layers} layers each; "
          f"{args.heads} heads / {args.kv_heads} KV heads of {args.head_dim}, blocks of {args.block_size})")
    names = " ".join(f"{name + ' ms':>10}" for name in res[args.lens[0]])
    print(f"{'tokens':>7} {names}   rows/tiles  GFLOP/s tiles")
    for n, ms in res.items():
        cells = " ".join(f"{t * 1e3:10.2f}" for t in ms.values())
        print(f"{n:7d} {cells}   {ms['rows'] / ms['tiles']:9.2f}x  {flop(n) / ms['tiles'] / 1e9:12.1f}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lens", type=int, nargs="+", default=[256, 1024, 2048, 4096], help="prompt lengths")
    p.add_argument("--layers", type=int, default=4, help="layers per timed call (caches of their own)")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-torch", action="store_true", help="only the C kernel's two calls")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    assert build.available(), "the C kernels did not build (see the log)"
    res = roofline.in_thread(lambda: measure(args), args.threads)
    report(args, res)
    return res


if __name__ == "__main__":
    main()
