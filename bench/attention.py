"""Attention alone on the CPU: the C kernel against the PyTorch path, each variant's result
checked against kernels/reference.py before anything is timed.

    python -m bench.attention decode           # one decode step: batch 32, contexts 173-440
    python -m bench.attention decode --hot     # every table points at 4 blocks: compute only
    python -m bench.attention prompt           # prompts of 256, 1024, 2048 and 4096 tokens

decode: ms per engine step (every layer once) and GB/s of K/V read (SmolLM2 at batch 32 reads
~450 MB scattered in blocks of 16); `cpu-fp16` is the C kernel over an fp16 copy of the cache.
prompt: one prompt chunk's rows, `rows` (each row alone) against `tiles` (the engine's call with
cu_seqlens: 16 rows at a time, each block's K/V once per tile) and `torch` (SDPA over a gathered
copy); tiles must equal rows bit for bit. Variants alternate (ABBA) on a thread of their own.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench import roofline, stats
from inferline.kernels import reference
from inferline.kernels.cpu import attention, build


def decode_variants(args, gen) -> tuple[dict, dict]:
    """name: a step's call over every layer; name: K/V bytes it reads."""
    bs, width, n = args.block_size, -(-args.max_context // args.block_size), args.batch
    shape = (args.layers, 2, args.num_blocks, bs, args.kv_heads, args.head_dim)
    cache = torch.randn(shape, generator=gen)
    lens = torch.randint(args.min_context, args.max_context + 1, (n,), generator=gen).int()
    assert n * width <= args.num_blocks, "--num-blocks too small for the batch"
    # Every block somewhere else in the cache, as after many steps; or 4 hot blocks.
    spread = torch.randperm(args.num_blocks, generator=gen)[: n * width]
    ids = torch.arange(n * width) % 4 if args.hot else spread
    tables = ids.view(n, width).to(torch.int32).contiguous()
    q = torch.randn(n, args.heads, args.head_dim, generator=gen)
    scale = args.head_dim**-0.5
    caches = {
        "cpu": (attention.paged_decode_attention_cpu, cache),
        "cpu-fp16": (attention.paged_decode_attention_cpu, cache.half()),
        "torch": (reference.paged_decode_attention, cache),
    }
    for name, (fn, c) in caches.items():
        want = reference.paged_decode_attention(q, c[0, 0], c[0, 1], tables, lens, scale)
        got, msg = fn(q, c[0, 0], c[0, 1], tables, lens, scale), f"{name} differs from reference.py"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=msg)
    elements = float(lens.sum()) * args.kv_heads * args.head_dim * 2 * args.layers

    def step(fn, c):  # every layer once
        return lambda: [fn(q, c[i, 0], c[i, 1], tables, lens, scale) for i in range(args.layers)]

    fns = {name: step(fn, c) for name, (fn, c) in caches.items()}
    return fns, {name: elements * c.dtype.itemsize for name, (_, c) in caches.items()}


def prompt_variants(args, n: int, gen) -> dict:
    """name: one prompt chunk of n tokens through every layer; tiles checked against rows."""
    bs, blocks = args.block_size, -(-n // args.block_size) + 1
    shape = (args.layers, 2, blocks, bs, args.kv_heads, args.head_dim)
    caches = list(torch.randn(shape, generator=gen))
    table = torch.randperm(blocks, generator=gen)[: blocks - 1].to(torch.int32).view(1, -1)
    rows = table.expand(n, -1).contiguous()
    q, scale = torch.randn(n, args.heads, args.head_dim, generator=gen), args.head_dim**-0.5
    i32 = torch.int32
    ctx, cu = torch.arange(1, n + 1, dtype=i32), torch.tensor([0, n], dtype=i32)
    lens = torch.tensor([n], dtype=i32)
    call = attention.paged_decode_attention_cpu
    fns = {
        "rows": lambda: [call(q, k, v, rows, ctx, scale) for k, v in caches],
        "tiles": lambda: [call(q, k, v, table, ctx, scale, cu) for k, v in caches],
        "torch": lambda: [
            reference.paged_prefill_attention(q, k, v, table, cu, lens, scale) for k, v in caches
        ],
    }
    first = {name: fn()[0] for name, fn in fns.items()}
    assert torch.equal(first["tiles"], first["rows"]), "tiles differ from rows a row at a time"
    err = float((first["tiles"] - first["torch"]).norm() / first["torch"].norm())
    assert err < 1e-5, f"tiles differ from the PyTorch prefill: relative error {err:.2e}"
    return fns


def timed(fns: dict, repeats: int) -> dict[str, list[float]]:
    times = {name: [] for name in fns}
    for name in stats.abba(list(fns), repeats):
        start = time.perf_counter()
        fns[name]()
        times[name].append(time.perf_counter() - start)
    return times


def measure(args) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    if args.mode == "decode":
        fns, kv_bytes = decode_variants(args, gen)
        return {"times": timed(fns, args.repeats), "kv_bytes": kv_bytes}
    return {
        n: {
            name: statistics.median(ts) / args.layers
            for name, ts in timed(prompt_variants(args, n, gen), args.repeats).items()
        }
        for n in args.lens
    }


def report(args, res: dict) -> None:
    print(
        f"{args.layers} layers, {args.heads} heads / {args.kv_heads} KV heads of "
        f"{args.head_dim}, blocks of {args.block_size}, {torch.get_num_threads()} threads, "
        f"{args.repeats} calls per variant (medians)"
    )
    if args.mode == "decode":
        hot = " (hot: 4 blocks)" if args.hot else ""
        print(
            f"decode step, batch {args.batch}, contexts {args.min_context}-{args.max_context}{hot}:"
        )
        for name, ts in res["times"].items():
            med = statistics.median(ts)
            gbs = f"{res['kv_bytes'][name] / med / 1e9:5.1f} GB/s of K/V"
            print(f"  {name:<8} {med * 1e3:7.1f} ms/step (min {min(ts) * 1e3:6.1f}), {gbs}")
        return
    names = " ".join(f"{name + ' ms':>10}" for name in res[args.lens[0]])
    print(f"{'tokens':>7} {names}   rows/tiles  GFLOP/s tiles")
    for n, ms in res.items():
        cells = " ".join(f"{t * 1e3:10.2f}" for t in ms.values())
        flop = n * (n + 1) / 2 * args.heads * args.head_dim * 4  # QK and PV
        print(
            f"{n:7d} {cells}   {ms['rows'] / ms['tiles']:9.2f}x  {flop / ms['tiles'] / 1e9:12.1f}"
        )


def parse_args(argv=None):
    p = stats.parser("attention", __doc__, threads=2)
    p.add_argument("mode", choices=("decode", "prompt"))
    p.add_argument("--layers", type=int, help="default: 30 (decode), 4 (prompt)")
    p.add_argument("--repeats", type=int, help="calls per variant; default: 12 decode, 6 prompt")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=32, help="decode")
    p.add_argument("--min-context", type=int, default=173, help="decode")
    p.add_argument("--max-context", type=int, default=440, help="decode")
    p.add_argument("--num-blocks", type=int, default=1356, help="decode: the engine's 1 GB cache")
    p.add_argument("--hot", action="store_true", help="decode: tables point at 4 blocks")
    p.add_argument("--lens", type=int, nargs="+", default=[256, 1024, 2048, 4096], help="prompt")
    args = p.parse_args(argv)
    decode = args.mode == "decode"
    args.layers = args.layers or (30 if decode else 4)
    args.repeats = args.repeats or (12 if decode else 6)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not build.available():
        raise SystemExit("the C kernels could not be built here (no C compiler?): nothing to time")
    res = roofline.in_thread(lambda: measure(args), args.threads)
    report(args, res)
    return res


if __name__ == "__main__":
    main()
