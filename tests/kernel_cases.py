"""Kernel cases run under the Triton interpreter, in their own process.

    python tests/kernel_cases.py GROUP SEED

An out-of-range load kills the interpreter's process (signal 11), so tests/kernels/test_kernels.py
runs this script in a subprocess and reads one JSON line per finished case; a case that never
reports is a failure too. TRITON_INTERPRET must be set before triton is first imported.

Every case draws fresh shapes from SEED: the cache is NaN everywhere a token was not written,
block-table padding holds out-of-range garbage, and outputs are NaN-poisoned before the call,
so an unmasked load, a leaked NaN or an unwritten element all show up as a failure.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
# As a script its folder (tests/, which holds a `kernels` package) comes first on the path: drop
# it, and find `tests` after site-packages (where Hugging Face's `kernels` and inferline live).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.append(os.path.dirname(_HERE))

import torch  # noqa: E402

from inferline.kernels import reference  # noqa: E402
from inferline.kernels.triton.decode import paged_decode_attention_triton, plan_decode  # noqa: E402
from inferline.kernels.triton.launch import INTERPRETER  # noqa: E402
from inferline.kernels.triton.prefill import paged_prefill_attention_triton  # noqa: E402
from inferline.kernels.triton.store import store_kv_triton  # noqa: E402
from tests.paged_cache import GARBAGE_BLOCK, PagedCache  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-2}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GQA_RATIOS = (1, 3, 4, 8)
BLOCK_SIZES = (8, 16, 32)
HEAD_DIMS = (64, 80, 96, 128, 256)
TABLE_TOKENS = 2048  # the split-length cases' table width: a graph's plan, sized for this


def report(name: str, ok: bool, **detail) -> None:
    print(json.dumps({"name": name, "ok": bool(ok), **detail}), flush=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def poisoned_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


def pick(gen, options):
    return options[int(torch.randint(len(options), (1,), generator=gen))]


def randint(gen, lo, hi) -> int:
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def matrix(full: bool):
    """(index, dtype, gqa, block_size, head_dim): CI covers every value of every axis (plus block
    sizes 64 and 128); the slow variant the whole cross product of dtype x GQA x block size."""
    combos = [(g, b) for g in GQA_RATIOS for b in BLOCK_SIZES]
    if not full:
        cases = [
            (i, DTYPES[i % 3], g, b, HEAD_DIMS[i % len(HEAD_DIMS)])
            for i, (g, b) in enumerate(combos)
        ]
        # the largest pages too (tile inside one page): block sizes 64 and 128
        return cases + [(12, torch.float16, 4, 64, 128), (13, torch.bfloat16, 8, 128, 64)]
    return [
        (i, d, g, b, HEAD_DIMS[i % len(HEAD_DIMS)])
        for i, (d, (g, b)) in enumerate((d, c) for d in DTYPES for c in combos)
    ]


def shape_of(gen, gqa):
    num_kv_heads = pick(gen, (1, 2)) if gqa < 8 else 1
    return num_kv_heads, num_kv_heads * gqa


def decode_case(gen, idx, dtype, gqa, block_size, head_dim) -> None:
    num_kv_heads, num_heads = shape_of(gen, gqa)
    lens = [1, block_size - 1, block_size + 1, randint(gen, 150, 400)]
    cache = PagedCache(gen, lens, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale)
    ref = reference.paged_decode_attention(*args)
    for label, kw in (
        ("gpu plan", {}),  # what an H200 launches for these shapes (kernels/triton/launch.py)
        ("split", {"num_splits": randint(gen, 2, 5), "block_n": pick(gen, (16, 32, 64))}),
    ):
        out = poisoned_like(q)
        result = paged_decode_attention_triton(*args, out=out, **kw)
        err = rel_err(out, ref)
        shape = f"gqa={gqa} kvh={num_kv_heads} bs={block_size} d={head_dim}"
        name = f"decode[{idx}:{label}] {str(dtype)[6:]} {shape} lens={lens} {kw}"
        report(name, result is out and err <= TOL[dtype], err=err, tol=TOL[dtype])


def split_len_case(gen, idx, dtype, gqa, block_size, head_dim) -> None:
    """One plan for tables TABLE_TOKENS wide (a CUDA graph's) run on steps of other contexts, the
    split length rewritten in one buffer each step: a longest context far shorter than the table
    (several splits), one that fits one split (stage 2 passes over it; a flat step launches no
    stage 2), one that fills the table; any split length the grid covers; a shorter one fails."""
    num_kv_heads, num_heads = shape_of(gen, gqa)
    width = TABLE_TOKENS // block_size
    plan = plan_decode(3, num_heads, num_kv_heads, head_dim, block_size, width, dtype, INTERPRETER)
    shape = f"{str(dtype)[6:]} gqa={gqa} kvh={num_kv_heads} bs={block_size} d={head_dim}"
    buffer = torch.zeros(1, dtype=torch.int32)  # the graph's: one tensor, new contents each step
    steps = (
        ("short", [1, randint(gen, 100, 400), randint(gen, 600, 1000)], None),
        ("one split", [0, 5, randint(gen, 20, 250)], None),
        ("max", [randint(gen, 1, 100), 7, TABLE_TOKENS], None),
        ("covering", [randint(gen, 1, 300), 3, randint(gen, 1000, TABLE_TOKENS)], "any"),
    )
    for label, lens, pick_len in steps:
        longest = max(lens)
        least = -(-longest // plan.num_splits)  # the shortest split length the grid covers
        split_len = plan.split_len_for(longest) if pick_len is None else randint(gen, least, 2100)
        buffer.fill_(split_len)
        args, ref = wide_decode_args(
            gen, lens, block_size, num_kv_heads, num_heads, head_dim, dtype
        )
        splits = -(-longest // split_len)
        name = f"split_len[{idx}:{label}] {shape} lens={lens} split_len={split_len} ({splits})"
        runs = [("graph", {"split_len": buffer})]
        if splits == 1:
            runs.append(("flat", {"split_len": buffer.clone(), "reduce": False}))
        for how, kw in runs:
            out = poisoned_like(args[0])
            paged_decode_attention_triton(*args, plan=plan, out=out, **kw)
            err = rel_err(out, ref)
            report(f"{name} {how}", err <= TOL[dtype], err=err, tol=TOL[dtype])
    # A split length one token short of covering the longest context: the range check refuses it.
    buffer.fill_(least - 1)
    expect_assert(
        f"split_len[{idx}] short refused",
        lambda: paged_decode_attention_triton(*args, plan=plan, split_len=buffer),
    )
    # Unchecked (as on CUDA) the kernels read what the buffer holds: half that misses half.
    buffer.fill_(least // 2)
    os.environ["INFERLINE_KERNEL_CHECKS"] = "0"
    try:
        err = rel_err(paged_decode_attention_triton(*args, plan=plan, split_len=buffer), ref)
    finally:
        del os.environ["INFERLINE_KERNEL_CHECKS"]
    report(f"split_len[{idx}] short gives a mismatch", err > TOL[dtype], err=err)


def wide_decode_args(gen, lens, block_size, num_kv_heads, num_heads, head_dim, dtype):
    """(launcher arguments, reference output) for `lens` on tables TABLE_TOKENS wide."""
    cache = PagedCache(gen, lens, block_size, num_kv_heads, head_dim, dtype)
    width = TABLE_TOKENS // block_size
    tables = torch.full((len(lens), width), GARBAGE_BLOCK, dtype=torch.int32)
    used = min(width, cache.block_tables.shape[1])
    tables[:, :used] = cache.block_tables[:, :used]
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    args = (q, cache.k_cache, cache.v_cache, tables, cache.context_lens, head_dim**-0.5)
    return args, reference.paged_decode_attention(*args)


def prefill_case(gen, idx, dtype, gqa, block_size, head_dim) -> None:
    num_kv_heads, num_heads = shape_of(gen, gqa)
    long_ctx = randint(gen, 120, 240)
    # (context_len, q_len): a one-token prompt, a plain prefill, a chunk on cached context, and a
    # long context with a long chunk (every third case a whole plain prefill of a few hundred).
    pairs = [
        (1, 1),
        (block_size - 1, block_size - 1),
        (block_size + 1, randint(gen, 1, 3)),
        (long_ctx, long_ctx if idx % 3 == 0 else randint(gen, 20, 70)),
    ]
    lens = [c for c, _ in pairs]
    cache = PagedCache(gen, lens, block_size, num_kv_heads, head_dim, dtype)
    q_lens = torch.tensor([n for _, n in pairs])
    cu = torch.zeros(len(pairs) + 1, dtype=torch.int32)
    cu[1:] = q_lens.cumsum(0)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen).to(dtype)
    args = (
        q,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        cu,
        cache.context_lens,
        head_dim**-0.5,
    )
    ref = reference.paged_prefill_attention(*args)
    # the GPU's plan, and on every other case other tile sizes too
    for tiles in ({}, {"block_m": pick(gen, (16, 32)), "block_n": pick(gen, (16, 32, 64))})[
        : 1 + idx % 2
    ]:
        out = poisoned_like(q)
        result = paged_prefill_attention_triton(*args, out=out, **tiles)
        err = rel_err(out, ref)
        shape = f"gqa={gqa} kvh={num_kv_heads} bs={block_size} d={head_dim}"
        name = f"prefill[{idx}] {str(dtype)[6:]} {shape} pairs={pairs} {tiles or 'gpu plan'}"
        report(name, result is out and err <= TOL[dtype], err=err, tol=TOL[dtype])


def window_case(gen, idx, dtype, gqa, block_size, head_dim) -> None:
    """Sliding windows (keys p - window < j <= p): one key, under a page, over a page, a long one
    and one past every context, through both kernels, the decode with several splits too (they
    cut the window, not the context) and the prefill with small tiles (the window's edge, the
    keys every row sees and the diagonal band in separate loops)."""
    num_kv_heads, num_heads = shape_of(gen, gqa)
    scale = head_dim**-0.5
    shape = f"{str(dtype)[6:]} gqa={gqa} kvh={num_kv_heads} bs={block_size} d={head_dim}"
    lens = [1, block_size + 1, randint(gen, 60, 200)]
    pairs = [(block_size + 3, block_size + 3), (randint(gen, 60, 200), randint(gen, 20, 50))]
    windows = (1, randint(gen, 2, block_size), block_size + 3, randint(gen, 20, 50), 1000)
    for window in windows[idx % 2 :: 2]:
        cache = PagedCache(gen, lens, block_size, num_kv_heads, head_dim, dtype)
        q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
        args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale)
        ref = reference.paged_decode_attention(*args, window=window)
        # the kernel on tables whose blocks behind the window are freed (NaN): never read
        freed = cache.tables_freed_behind(window, [n - 1 for n in lens])
        args = (q, cache.k_cache, cache.v_cache, freed, cache.context_lens, scale)
        for label, kw in (
            ("gpu plan", {}),
            ("split", {"num_splits": randint(gen, 2, 4), "block_n": 16}),
        ):
            out = poisoned_like(q)
            paged_decode_attention_triton(*args, out=out, window=window, **kw)
            err = rel_err(out, ref)
            name = f"window decode[{idx}:{label}] {shape} lens={lens} window={window} {kw}"
            report(name, err <= TOL[dtype], err=err, tol=TOL[dtype])
        cache = PagedCache(gen, [c for c, _ in pairs], block_size, num_kv_heads, head_dim, dtype)
        cu = torch.tensor([0, pairs[0][1], pairs[0][1] + pairs[1][1]], dtype=torch.int32)
        q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen).to(dtype)
        args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cu, cache.context_lens, scale)
        ref = reference.paged_prefill_attention(*args, window=window)
        freed = cache.tables_freed_behind(window, [c - n for c, n in pairs])
        args = (q, cache.k_cache, cache.v_cache, freed, cu, cache.context_lens, scale)
        for tiles in ({}, {"block_m": 16, "block_n": 16}):
            out = poisoned_like(q)
            paged_prefill_attention_triton(*args, out=out, window=window, **tiles)
            err = rel_err(out, ref)
            name = f"window prefill[{idx}] {shape} pairs={pairs} window={window} {tiles}"
            report(name, err <= TOL[dtype], err=err, tol=TOL[dtype])


def softcap_case(gen, idx, dtype, gqa, block_size, head_dim) -> None:
    """Gemma 2's attention logit soft-capping (cap * tanh(s / cap) of the scaled scores), a cap
    that bends most scores, alone and beside a sliding window, through both kernels: decodes
    with one split and several, prompts on cached context with the GPU's and small tiles."""
    num_kv_heads, num_heads = shape_of(gen, gqa)
    scale, cap = head_dim**-0.5 * 4, 1.0 + float(torch.rand((), generator=gen)) * 2
    shape = f"{str(dtype)[6:]} gqa={gqa} kvh={num_kv_heads} bs={block_size} d={head_dim}"
    window = (None, randint(gen, 5, 40))[(idx // 4) % 2]
    lens = [1, block_size + 1, randint(gen, 60, 200)]
    cache = PagedCache(gen, lens, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale)
    ref = reference.paged_decode_attention(*args, window=window, softcap=cap)
    for label, kw in (("gpu plan", {}), ("split", {"num_splits": 3, "block_n": 16})):
        out = poisoned_like(q)
        paged_decode_attention_triton(*args, out=out, window=window, softcap=cap, **kw)
        err = rel_err(out, ref)
        name = f"softcap decode[{idx}:{label}] {shape} lens={lens} cap={cap:.2f} window={window}"
        report(name, err <= TOL[dtype], err=err, tol=TOL[dtype])
    pairs = [(block_size + 3, block_size + 3), (randint(gen, 60, 200), randint(gen, 20, 50))]
    cache = PagedCache(gen, [c for c, _ in pairs], block_size, num_kv_heads, head_dim, dtype)
    cu = torch.tensor([0, pairs[0][1], pairs[0][1] + pairs[1][1]], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen).to(dtype)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cu, cache.context_lens, scale)
    ref = reference.paged_prefill_attention(*args, window=window, softcap=cap)
    for tiles in ({}, {"block_m": 16, "block_n": 16}):
        out = poisoned_like(q)
        paged_prefill_attention_triton(*args, out=out, window=window, softcap=cap, **tiles)
        err = rel_err(out, ref)
        name = f"softcap prefill[{idx}] {shape} pairs={pairs} cap={cap:.2f} window={window}"
        report(name, err <= TOL[dtype], err=err, tol=TOL[dtype])


def sinks_case(gen, idx, dtype, gqa, block_size, head_dim) -> None:
    """gpt-oss's attention sinks (a logit per head in each softmax, dropped after), weighty beside
    the keys, alone and beside a sliding window, through both kernels: decodes with one split
    (the sink where stage 1 writes the output) and several (once, in stage 2's combine),
    prompts on cached context with the GPU's and small tiles."""
    num_kv_heads, num_heads = shape_of(gen, gqa)
    scale = head_dim**-0.5
    sinks = torch.randn(num_heads, generator=gen) * 2 + 2
    shape = f"{str(dtype)[6:]} gqa={gqa} kvh={num_kv_heads} bs={block_size} d={head_dim}"
    window = (None, randint(gen, 5, 40))[(idx // 4) % 2]
    lens = [1, block_size + 1, randint(gen, 60, 200)]
    cache = PagedCache(gen, lens, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale)
    ref = reference.paged_decode_attention(*args, window=window, sinks=sinks)
    for label, kw in (("gpu plan", {}), ("split", {"num_splits": 3, "block_n": 16})):
        out = poisoned_like(q)
        paged_decode_attention_triton(*args, out=out, window=window, sinks=sinks, **kw)
        err = rel_err(out, ref)
        name = f"sinks decode[{idx}:{label}] {shape} lens={lens} window={window}"
        report(name, err <= TOL[dtype], err=err, tol=TOL[dtype])
    pairs = [(block_size + 3, block_size + 3), (randint(gen, 60, 200), randint(gen, 20, 50))]
    cache = PagedCache(gen, [c for c, _ in pairs], block_size, num_kv_heads, head_dim, dtype)
    cu = torch.tensor([0, pairs[0][1], pairs[0][1] + pairs[1][1]], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen).to(dtype)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cu, cache.context_lens, scale)
    ref = reference.paged_prefill_attention(*args, window=window, sinks=sinks)
    for tiles in ({}, {"block_m": 16, "block_n": 16}):
        out = poisoned_like(q)
        paged_prefill_attention_triton(*args, out=out, window=window, sinks=sinks, **tiles)
        err = rel_err(out, ref)
        name = f"sinks prefill[{idx}] {shape} pairs={pairs} window={window} {tiles}"
        report(name, err <= TOL[dtype], err=err, tol=TOL[dtype])


def store_case(gen, idx, dtype, block_size, head_dim) -> None:
    num_kv_heads, num_blocks, num_tokens = pick(gen, (1, 2, 3)), 6, 40
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:7]] = -1  # skipped tokens
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(k, v, want_k, want_v, slots)
    store_kv_triton(k, v, k_cache, v_cache, slots)
    same = bits_equal(k_cache, want_k) and bits_equal(v_cache, want_v)
    untouched = int(torch.isnan(k_cache).flatten(0, 1).all(-1).all(-1).sum())
    name = f"store[{idx}] {str(dtype)[6:]} bs={block_size} kvh={num_kv_heads} d={head_dim}"
    report(
        name,
        same and untouched == num_blocks * block_size - (slots >= 0).sum().item(),
        untouched=untouched,
    )


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_int = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    return torch.equal(a.view(as_int[a.dtype]), b.view(as_int[b.dtype]))


def expect_assert(name: str, fn) -> None:
    try:
        fn()
    except AssertionError as e:
        report(name, True, message=str(e)[:120])
        return
    report(name, False, message="no AssertionError")


def checks_cases(gen) -> None:
    """Launchers refuse bad inputs before launching (so nothing out of range is ever read)."""
    cache = PagedCache(gen, [5, 20], 8, 1, 64, torch.float32)
    q = torch.randn(2, 2, 64)
    kc, vc, bt, cl = cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens
    bad_bt = bt.clone()
    bad_bt[1, 2] = kc.shape[0]  # a used entry past the last block
    expect_assert(
        "checks: table entry out of range",
        lambda: paged_decode_attention_triton(q, kc, vc, bad_bt, cl, 0.1),
    )
    long = torch.tensor([5, bt.shape[1] * 8 + 1], dtype=torch.int32)
    expect_assert(
        "checks: context longer than table",
        lambda: paged_decode_attention_triton(q, kc, vc, bt, long, 0.1),
    )
    expect_assert(
        "checks: q dtype", lambda: paged_decode_attention_triton(q.half(), kc, vc, bt, cl, 0.1)
    )
    expect_assert(
        "checks: int64 table", lambda: paged_decode_attention_triton(q, kc, vc, bt.long(), cl, 0.1)
    )
    strided = torch.randn(2, 2, 128)[..., ::2]
    expect_assert(
        "checks: q stride", lambda: paged_decode_attention_triton(strided, kc, vc, bt, cl, 0.1)
    )
    cu = torch.tensor([0, 1, 22], dtype=torch.int32)  # second sequence: q_len 21 > context 20
    qp = torch.randn(22, 2, 64)
    expect_assert(
        "checks: q_len > context",
        lambda: paged_prefill_attention_triton(qp, kc, vc, bt, cu, cl, 0.1),
    )
    k = torch.randn(3, 1, 64)
    slots = torch.tensor([0, kc.shape[0] * 8, 1])
    expect_assert("checks: slot out of range", lambda: store_kv_triton(k, k, kc, vc, slots))
    expect_assert("checks: int32 slots", lambda: store_kv_triton(k, k, kc, vc, slots.int()))
    expect_assert(
        "checks: k dtype",
        lambda: store_kv_triton(k.half(), k.half(), kc, vc, torch.tensor([0, 1, 2])),
    )
    # A zero-length context has no keys: both paths define its output as 0.
    zero = torch.tensor([0, 20], dtype=torch.int32)
    out = paged_decode_attention_triton(q, kc, vc, bt, zero, 0.1, num_splits=2, block_n=16)
    ref = reference.paged_decode_attention(q, kc, vc, bt, zero, 0.1)
    report("checks: zero context", bool(out[0].eq(0).all()) and rel_err(out, ref) <= 1e-4)


def main() -> None:
    group, seed = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)  # the interpreter is Python-bound; leave the other core alone
    gen = torch.Generator().manual_seed(seed)
    if group in ("decode", "decode_full"):
        for case in matrix(group.endswith("full")):
            decode_case(gen, *case)
    elif group == "split_len":
        for case in matrix(False)[::2]:
            split_len_case(gen, *case)
    elif group in ("prefill", "prefill_full"):
        for case in matrix(group.endswith("full")):
            prefill_case(gen, *case)
    elif group == "window":
        for case in matrix(False)[1::6]:
            window_case(gen, *case)
    elif group == "softcap":
        for case in matrix(False)[::4]:
            softcap_case(gen, *case)
    elif group == "sinks":
        for case in matrix(False)[2::4]:
            sinks_case(gen, *case)
    elif group == "store":
        for i, (dtype, bs) in enumerate((d, b) for d in DTYPES for b in BLOCK_SIZES):
            store_case(gen, i, dtype, bs, HEAD_DIMS[i % len(HEAD_DIMS)])
    elif group == "checks":
        checks_cases(gen)
    else:
        raise SystemExit(f"unknown group {group!r}")


if __name__ == "__main__":
    main()
