"""The compiled CPU decode-attention kernel (kernels/cpu/) against the PyTorch reference on
random shapes, its checks, its build and its fallback.

Shapes are drawn fresh each run from a printed seed; INFERLINE_KERNEL_SEED=<n> replays one.
The cache holds NaN wherever no token was written and block tables carry out-of-range padding
(tests/paged_cache.py), so a read outside a context shows up as NaN or a crash.
"""

from __future__ import annotations

import fnmatch
import os
import platform
import random
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import torch

from inferline import kernels
from inferline.kernels import reference
from inferline.kernels.backends import ModelShape, select_attention
from inferline.kernels.cpu import attention, build
from tests.paged_cache import PagedCache

SEED = int(os.environ.get("INFERLINE_KERNEL_SEED", random.randrange(1 << 31)))

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="no C compiler: the engine uses the PyTorch path",
)


def auto_attention(device, dtype, shape=(64, 8, 16), kv_dtype=None) -> str:
    """What INFERLINE_MODEL__ATTENTION_BACKEND=auto picks; shape = (head_dim, num_heads,
    block_size)."""
    head_dim, num_heads, block_size = shape
    return select_attention(
        device, dtype, kv_dtype or dtype, ModelShape(head_dim, num_heads, 1, block_size)
    )


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(SEED)


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def random_lens(gen, block_size: int, n: int) -> list[int]:
    edges = [1, block_size - 1, block_size, block_size + 1]
    return edges + [int(x) for x in torch.randint(2, 600, (n,), generator=gen)]


@pytest.mark.parametrize("gqa", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [48, 64, 80, 128, 256])
def test_cpu_decode_matches_reference(gen, gqa, block_size, head_dim):
    num_kv_heads = int(torch.randint(1, 4, (1,), generator=gen))
    lens = random_lens(gen, block_size, 6)
    cache = PagedCache(gen, lens, block_size, num_kv_heads, head_dim, torch.float32)
    q = torch.randn(len(lens), num_kv_heads * gqa, head_dim, generator=gen)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, head_dim**-0.5)
    out = kernels.paged_decode_attention(*args, backend="cpu")
    ref = reference.paged_decode_attention(*args)
    assert not out.isnan().any(), f"seed {SEED}: NaN from an unwritten slot"
    for i, n in enumerate(lens):
        assert rel_err(out[i], ref[i]) < 1e-5, f"seed {SEED}, seq {i}, len {n}"


@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cpu_decode_over_an_fp16_cache_matches_reference(gen, gqa, head_dim):
    """INFERLINE_CACHE__DTYPE=float16: the kernel widens the halves it reads; the reference reads
    the same halves (upcast), so both compute over identical values, in fp32."""
    lens = random_lens(gen, 16, 6) + [1300]  # one context split into parts
    cache = PagedCache(gen, lens, 16, 2, head_dim, torch.float16)
    assert cache.k_cache.dtype == torch.float16
    q = torch.randn(len(lens), 2 * gqa, head_dim, generator=gen)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, head_dim**-0.5)
    assert auto_attention(q.device, q.dtype, (head_dim, 2 * gqa, 16), torch.float16) == "cpu"
    out = kernels.paged_decode_attention(*args)
    ref = reference.paged_decode_attention(*args)
    assert out.dtype == torch.float32 and not out.isnan().any(), (
        f"seed {SEED}: NaN from an unwritten slot"
    )
    for i, n in enumerate(lens):
        assert rel_err(out[i], ref[i]) < 1e-5, f"seed {SEED}, seq {i}, len {n}"
    alone = attention.paged_decode_attention_cpu(
        q[-1:],
        cache.k_cache,
        cache.v_cache,
        cache.block_tables[-1:],
        cache.context_lens[-1:],
        head_dim**-0.5,
    )
    assert torch.equal(alone[0], out[-1]), "a sequence's result depends on its batch"


def test_fp16_cache_of_a_head_size_the_kernel_does_not_take_goes_to_torch():
    assert not attention.supports_kv_half(72) and attention.supports_kv_half(48)
    assert auto_attention(torch.device("cpu"), torch.float32, (72, 4, 16), torch.float16) == "torch"
    assert (
        auto_attention(torch.device("cpu"), torch.float32, (64, 9, 16), torch.bfloat16) == "torch"
    )


@pytest.mark.parametrize("block_size", [16, 32])
def test_cpu_decode_splits_long_contexts_and_matches_reference(gen, block_size):
    """Contexts over 512 tokens are split into items and combined; lengths at the split's edges."""
    lens = [2049, 1, 512, 513, 1024, 1500]
    cache = PagedCache(gen, lens, block_size, 3, 64, torch.float32)
    q = torch.randn(len(lens), 9, 64, generator=gen) * 3
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125)
    out, ref = attention.paged_decode_attention_cpu(*args), reference.paged_decode_attention(*args)
    for i, n in enumerate(lens):
        assert rel_err(out[i], ref[i]) < 1e-5, f"seed {SEED}, seq {i}, len {n}"
    alone = attention.paged_decode_attention_cpu(
        q[:1], cache.k_cache, cache.v_cache, cache.block_tables[:1], cache.context_lens[:1], 0.125
    )
    assert torch.equal(alone[0], out[0]), "a sequence's result depends on its batch"


def prompt_chunks(gen, lens, q_lens, block_size, num_kv_heads, gqa, head_dim, dtype=torch.float32):
    """Sequences of lens[i] tokens whose last q_lens[i] are this step's rows (as the engine sends
    prompt chunks: ModelRunner._token_tables): the cache, q, cu_seqlens, each row's context
    length (position + 1) and each row's own copy of its sequence's block table."""
    cache = PagedCache(gen, lens, block_size, num_kv_heads, head_dim, dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_kv_heads * gqa, head_dim, generator=gen)
    rows = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(q_lens))
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(lens, q_lens)])
    return (
        cache,
        q,
        cu,
        (positions + 1).to(torch.int32),
        cache.block_tables.index_select(0, rows).contiguous(),
    )


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim,gqa", [(64, 3), (128, 1), (48, 4)])
def test_prompt_rows_attended_as_decodes_match_reference_prefill(gen, block_size, head_dim, gqa):
    """The engine's CPU path for prompt chunks: each query row attends as a decode over its own
    causal context (position + 1 tokens) of its sequence's blocks, rows of one sequence in
    tiles. Whole prompts, chunks after cached context, a one-token chunk, a long one split
    into parts, tiles cut short: equal to the reference prefill."""
    lens, q_lens = [37, 300, 90, 700, 5, 1100], [37, 120, 1, 600, 5, 17]
    cache, q, cu, ctx, _ = prompt_chunks(gen, lens, q_lens, block_size, 2, gqa, head_dim)
    out = kernels.paged_decode_attention(
        q,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        ctx,
        head_dim**-0.5,
        backend="cpu",
        cu_seqlens_q=cu,
    )
    ref = reference.paged_prefill_attention(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cu, cache.context_lens, head_dim**-0.5
    )
    assert not out.isnan().any(), f"seed {SEED}: NaN from an unwritten slot"
    for i in range(len(lens)):
        lo, hi = int(cu[i]), int(cu[i + 1])
        assert rel_err(out[lo:hi], ref[lo:hi]) < 1e-5, (
            f"seed {SEED}, seq {i}, len {lens[i]}, chunk {q_lens[i]}"
        )
    torch_path = kernels.paged_decode_attention(
        q,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        ctx,
        head_dim**-0.5,
        backend="torch",
        cu_seqlens_q=cu,
    )
    assert rel_err(torch_path, ref) < 1e-5, f"seed {SEED}: the torch path with cu_seqlens_q"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 48])
@pytest.mark.parametrize("threads", [1, 2])
def test_prompt_rows_in_tiles_have_the_bits_of_decodes(gen, dtype, head_dim, threads):
    """A prompt row's output is bit for bit what the decode path gives it alone with its
    context (tiles share K/V loads and compute scores from transposed K, in the same order of
    additions): a prompt's rows are computed as its decode steps will be, so a sequence
    recomputed after preemption, or whose prefix came from the cache, gets the same tokens."""
    if dtype == torch.float16 and not attention.supports_kv_half(head_dim):
        pytest.skip("this build has no fp16 conversions")
    lens, q_lens = [40, 700, 33, 1200, 16], [40, 650, 1, 30, 16]
    cache, q, cu, ctx, row_tables = prompt_chunks(gen, lens, q_lens, 16, 3, 3, head_dim, dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        tiled = attention.paged_decode_attention_cpu(
            q, cache.k_cache, cache.v_cache, cache.block_tables, ctx, 0.125, cu
        )
        per_row = attention.paged_decode_attention_cpu(
            q, cache.k_cache, cache.v_cache, row_tables, ctx, 0.125
        )
    finally:
        torch.set_num_threads(before)
    assert torch.equal(tiled, per_row), (
        f"seed {SEED}: rows differ at {(tiled != per_row).nonzero()[:4].tolist()}"
    )
    alone = attention.paged_decode_attention_cpu(
        q[100:101], cache.k_cache, cache.v_cache, row_tables[100:101], ctx[100:101], 0.125
    )
    assert torch.equal(alone[0], tiled[100])


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("head_dim,gqa", [(64, 3), (48, 4)])
@pytest.mark.parametrize("window", [1, 5, 19, 600])
def test_sliding_windows_match_reference(gen, block_size, head_dim, gqa, window):
    """A sliding window (keys p - window < j <= p) in decodes, long ones over several parts, and
    in prompt rows in tiles (rows whose windows start in different blocks): the reference's
    output, and no part before a window read (the cache there is NaN-free, yet a part wholly
    before the window must add nothing). Both kernels again on tables whose blocks behind the
    window point at a NaN block (the engine's freed blocks): the same output, so never read."""
    lens = [1, 9, 40, 700, 1300]
    cache = PagedCache(gen, lens, block_size, 2, head_dim, torch.float32)
    q = torch.randn(len(lens), 2 * gqa, head_dim, generator=gen)
    freed = cache.tables_freed_behind(window, [n - 1 for n in lens])
    ref = reference.paged_decode_attention(
        q,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        cache.context_lens,
        0.125,
        window=window,
    )
    for tables in (cache.block_tables, freed):
        args = (q, cache.k_cache, cache.v_cache, tables, cache.context_lens, 0.125)
        out = attention.paged_decode_attention_cpu(*args, window=window)
        assert rel_err(out, ref) < 1e-5, f"seed {SEED}: decode, window {window}"
        out = reference.paged_decode_attention(*args, window=window)
        assert rel_err(out, ref) < 1e-6, f"seed {SEED}: reference decode, window {window}"
    lens, q_lens = [37, 300, 90, 700, 1100], [37, 120, 1, 600, 17]
    cache, q, cu, ctx, _ = prompt_chunks(gen, lens, q_lens, block_size, 2, gqa, head_dim)
    freed = cache.tables_freed_behind(window, [n - m for n, m in zip(lens, q_lens)])
    ref = reference.paged_prefill_attention(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cu, cache.context_lens, 0.125, window
    )
    for tables in (cache.block_tables, freed):
        out = attention.paged_decode_attention_cpu(
            q, cache.k_cache, cache.v_cache, tables, ctx, 0.125, cu, window=window
        )
        assert rel_err(out, ref) < 1e-5, f"seed {SEED}: prompt rows, window {window}"
        out = reference.paged_prefill_attention(
            q, cache.k_cache, cache.v_cache, tables, cu, cache.context_lens, 0.125, window
        )
        assert rel_err(out, ref) < 1e-6, f"seed {SEED}: reference prefill, window {window}"


@pytest.mark.parametrize("head_dim,window", [(64, None), (48, 7)])
def test_softcap_matches_reference(gen, head_dim, window):
    """Gemma 2's soft-capped scores (cap * tanh(s / cap)) in decodes (a long one over several
    parts) and in prompt rows in tiles, alone and beside a sliding window."""
    lens, cap, scale = [1, 9, 40, 700], 1.5, 0.5
    cache = PagedCache(gen, lens, 16, 2, head_dim, torch.float32)
    q = torch.randn(len(lens), 6, head_dim, generator=gen)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale)
    out = attention.paged_decode_attention_cpu(*args, window=window, softcap=cap)
    ref = reference.paged_decode_attention(*args, window=window, softcap=cap)
    assert rel_err(out, ref) < 1e-5, f"seed {SEED}: decode"
    lens, q_lens = [37, 300, 90], [37, 120, 1]
    cache, q, cu, ctx, _ = prompt_chunks(gen, lens, q_lens, 16, 2, 3, head_dim)
    kv = (cache.k_cache, cache.v_cache, cache.block_tables)
    out = attention.paged_decode_attention_cpu(q, *kv, ctx, scale, cu, window=window, softcap=cap)
    ref = reference.paged_prefill_attention(
        q, *kv, cu, cache.context_lens, scale, window=window, softcap=cap
    )
    assert rel_err(out, ref) < 1e-5, f"seed {SEED}: prompt rows"


@pytest.mark.parametrize("head_dim,window", [(64, None), (48, 7)])
def test_sinks_match_reference(gen, head_dim, window):
    """gpt-oss's attention sinks (a logit per head in each softmax, dropped after) in decodes (a
    long one over several parts: the sink joins once per row, not per part; an empty context
    gives 0) and in prompt rows in tiles, alone and beside a sliding window; they change the
    result."""
    lens, scale = [0, 1, 9, 40, 1300], 0.125  # sinks weighty beside the keys
    sinks = torch.randn(6, generator=gen) * 2 + 3
    cache = PagedCache(gen, lens, 16, 2, head_dim, torch.float32)
    q = torch.randn(len(lens), 6, head_dim, generator=gen)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale)
    out = attention.paged_decode_attention_cpu(*args, window=window, sinks=sinks)
    ref = reference.paged_decode_attention(*args, window=window, sinks=sinks)
    assert rel_err(out, ref) < 1e-5, f"seed {SEED}: decode"
    assert bool(out[0].eq(0).all()), "an empty context gives 0"
    plain = reference.paged_decode_attention(*args, window=window)
    assert rel_err(plain, ref) > 1e-2, "the sinks change nothing"
    lens, q_lens = [37, 600, 90], [37, 120, 1]
    cache, q, cu, ctx, _ = prompt_chunks(gen, lens, q_lens, 16, 2, 3, head_dim)
    kv = (cache.k_cache, cache.v_cache, cache.block_tables)
    out = attention.paged_decode_attention_cpu(q, *kv, ctx, scale, cu, window=window, sinks=sinks)
    ref = reference.paged_prefill_attention(
        q, *kv, cu, cache.context_lens, scale, window=window, sinks=sinks
    )
    assert rel_err(out, ref) < 1e-5, f"seed {SEED}: prompt rows"


@pytest.mark.parametrize("bad", ["not_from_0", "decreasing", "past_the_rows", "block_id"])
def test_prompt_rows_refuse_bad_cu_seqlens_before_reading(gen, bad):
    cache, q, cu, ctx, _ = prompt_chunks(gen, [40, 20], [40, 20], 16, 1, 2, 64)
    tables, cu = cache.block_tables.clone(), cu.clone()
    if bad == "not_from_0":
        cu[0] = 1
    elif bad == "decreasing":
        cu[1] = 70
    elif bad == "past_the_rows":
        cu[-1] = 61
    else:
        tables[1, 1] = cache.k_cache.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        attention.paged_decode_attention_cpu(q, cache.k_cache, cache.v_cache, tables, ctx, 0.1, cu)


@pytest.mark.parametrize("magnitude", [0.01, 30.0])
def test_cpu_decode_online_softmax_at_extreme_scores(gen, magnitude):
    """Scores spread by hundreds (a max that moves between blocks, exp underflowing to 0) and
    nearly flat scores: the online softmax still equals the reference."""
    cache = PagedCache(gen, [1, 17, 250, 513], 16, 3, 64, torch.float32)
    q = torch.randn(4, 9, 64, generator=gen) * magnitude
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125)
    out, ref = attention.paged_decode_attention_cpu(*args), reference.paged_decode_attention(*args)
    assert out.isfinite().all()
    assert rel_err(out, ref) < 1e-5, f"seed {SEED}"


def test_shapes_the_c_kernel_does_not_take_go_to_torch(gen):
    cache = PagedCache(gen, [30, 5], 16, 1, 72, torch.float32)
    q = torch.randn(2, 2, 72, generator=gen)  # head_dim 72: not a multiple of 16
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.1)
    assert not attention.supports(72, 2, 16) and attention.supports(64, 2, 16)
    assert auto_attention(torch.device("cpu"), torch.float32, (72, 2, 16)) == "torch"
    assert torch.equal(
        kernels.paged_decode_attention(*args), reference.paged_decode_attention(*args)
    )
    with pytest.raises(AssertionError, match="does not take"):
        attention.paged_decode_attention_cpu(*args)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_cpu_decode_same_for_any_thread_count(gen, threads):
    cache = PagedCache(gen, random_lens(gen, 16, 12), 16, 3, 64, torch.float32)
    q = torch.randn(16, 9, 64, generator=gen)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attention.paged_decode_attention_cpu(*args)
        torch.set_num_threads(threads)
        many = attention.paged_decode_attention_cpu(*args)
    finally:
        torch.set_num_threads(before)
    # One (sequence, KV head) is one thread's work, in one order: bitwise the same.
    assert torch.equal(one, many)


def test_cpu_decode_reads_q_as_a_view_of_fused_qkv(gen):
    cache = PagedCache(gen, [7, 70, 33], 16, 2, 64, torch.float32)
    qkv = torch.randn(3, 8 + 2 * 2, 64, generator=gen)  # [tokens, q heads + k heads + v heads, D]
    q = qkv[:, :8]
    assert not q.is_contiguous()
    args = (cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125)
    out = attention.paged_decode_attention_cpu(q, *args)
    assert torch.equal(out, attention.paged_decode_attention_cpu(q.contiguous(), *args))
    assert rel_err(out, reference.paged_decode_attention(q, *args)) < 1e-5


def test_cpu_decode_empty_context_and_empty_batch(gen):
    cache = PagedCache(gen, [0, 5], 16, 1, 64, torch.float32)
    q = torch.randn(2, 2, 64, generator=gen)
    out = attention.paged_decode_attention_cpu(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.1
    )
    assert torch.equal(out[0], torch.zeros(2, 64)), "a context of 0 tokens attends to nothing: 0"
    none = attention.paged_decode_attention_cpu(
        q[:0], cache.k_cache, cache.v_cache, cache.block_tables[:0], cache.context_lens[:0], 0.1
    )
    assert none.shape == (0, 2, 64)


@pytest.mark.parametrize("bad", ["block_id", "negative_block", "table_too_short", "negative_len"])
def test_cpu_decode_refuses_a_bad_table_before_reading(gen, bad):
    cache = PagedCache(gen, [40, 20], 16, 1, 64, torch.float32)
    tables, lens = cache.block_tables.clone(), cache.context_lens.clone()
    if bad == "block_id":
        tables[1, 1] = cache.k_cache.shape[0]  # one past the last block
    elif bad == "negative_block":
        tables[0, 2] = -1
    elif bad == "table_too_short":
        lens[0] = 16 * tables.shape[1] + 1
    else:
        lens[1] = -3
    q = torch.randn(2, 2, 64, generator=gen)
    with pytest.raises(RuntimeError, match="out of range"):
        attention.paged_decode_attention_cpu(q, cache.k_cache, cache.v_cache, tables, lens, 0.1)


def test_cpu_decode_asserts_layout(gen):
    cache = PagedCache(gen, [9], 16, 1, 64, torch.float32)
    q = torch.randn(1, 2, 64, generator=gen)
    args = (cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.1)
    with pytest.raises(AssertionError):
        attention.paged_decode_attention_cpu(q.bfloat16(), *args)
    with pytest.raises(AssertionError):
        attention.paged_decode_attention_cpu(
            torch.randn(1, 64, 2).transpose(1, 2), *args
        )  # heads not packed
    with pytest.raises(AssertionError):
        attention.paged_decode_attention_cpu(
            q, cache.k_cache, cache.v_cache, cache.block_tables.long(), cache.context_lens, 0.1
        )


def test_auto_backend_picks_the_cpu_kernel_for_fp32_only():
    cpu_dev = torch.device("cpu")
    assert auto_attention(cpu_dev, torch.float32) == "cpu"
    assert auto_attention(cpu_dev, torch.bfloat16) == "torch"
    assert auto_attention(torch.device("cuda"), torch.bfloat16) == "triton"


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """kernels.cpu as on a new machine: nothing built, an empty cache folder."""
    monkeypatch.setenv("INFERLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_tried", False)
    monkeypatch.setattr(build, "_lib", None)
    return tmp_path


def test_first_use_builds_into_the_cache_folder(fresh_build, gen):
    assert build.available()
    (built,) = (fresh_build / "kernels").glob("inferline_cpu-*.so")
    assert not list((fresh_build / "kernels").glob("tmp*")), (
        "the temporary build file was left behind"
    )
    cache = PagedCache(gen, [30], 16, 1, 64, torch.float32)
    q = torch.randn(1, 1, 64, generator=gen)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.1)
    assert (
        rel_err(
            attention.paged_decode_attention_cpu(*args), reference.paged_decode_attention(*args)
        )
        < 1e-5
    )


def test_failed_build_falls_back_to_torch(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", shutil.which("false"))  # a "compiler" that always fails
    assert not build.available()
    assert auto_attention(torch.device("cpu"), torch.float32) == "torch"
    assert not list((fresh_build / "kernels").glob("*")), "a failed build left a file behind"


def test_build_past_its_time_is_killed_and_falls_back_to_torch(fresh_build, monkeypatch):
    """A compiler that hangs (or a machine where the build takes minutes) must not hang the
    worker's start or raise from it: past BUILD_TIMEOUT_S the compiles are killed, the PyTorch
    path is used, and nothing is left in the cache folder."""
    hang = fresh_build / "hang-cc"
    hang.write_text("#!/bin/sh\nexec sleep 60\n")
    hang.chmod(0o755)
    monkeypatch.setenv("CC", str(hang))
    monkeypatch.setattr(build, "BUILD_TIMEOUT_S", 0.5)
    assert not build.available()
    assert auto_attention(torch.device("cpu"), torch.float32) == "torch"
    assert [p.name for p in (fresh_build / "kernels").iterdir()] == []


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not shutil.which("cc"),
    reason="cross-compiles for x86 targets with the system compiler",
)
@pytest.mark.parametrize("march", ["haswell", "skylake-avx512"])
def test_the_kernels_compile_for_avx2_and_avx512(tmp_path, march):
    """The library is built for the machine it runs on (-march=native), and its vectors take
    another path with AVX-512 (16 floats a register) than without (pairs of 8): CI's machine
    tries one. This compiles every source for both kinds of x86 machine (not run), so a change
    that breaks the other path fails here. At -O0: the intrinsics and their target checks are
    the same, the optimizer's time (most of a build) is not (the suite's budget)."""
    swap = {"-march=native": f"-march={march}", "-O3": "-O0"}
    flags = [swap.get(f, f) for f in build.FLAGS]
    for src in build.SOURCES:
        out = tmp_path / (src.stem + ".o")
        done = subprocess.run(
            ["cc", *flags, "-I", str(build.CSRC), "-c", str(src), "-o", str(out)],
            capture_output=True,
            text=True,
            timeout=build.BUILD_TIMEOUT_S,
        )
        assert done.returncode == 0, f"{src.name} for {march}: {done.stderr[-2000:]}"


def test_the_package_ships_every_source_and_header_the_build_reads():
    """A wheel (not only this checkout) must hold the C sources and headers: kernels/cpu/
    compiles them on the user's machine."""
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["inferline.kernels.cpu"]
    for path in build.SOURCES + build.HEADERS:
        name = path.relative_to(Path(build.__file__).parent).as_posix()
        assert any(fnmatch.fnmatch(name, g) for g in globs), (
            f"{name} is not in the package data {globs}"
        )
    on_disk = {p.name for p in build.CSRC.iterdir() if p.suffix in (".c", ".h")}
    assert on_disk == {p.name for p in build.SOURCES + build.HEADERS}, (
        "a C file the build does not list"
    )


def test_decode_attention_benchmark_runs_and_checks_against_reference(capsys):
    """bench/attention.py decode on a tiny step (a smoke test: it checks results, never times
    them)."""
    from bench import attention as bench_attention

    for hot in ([], ["--hot"]):
        res = bench_attention.main(
            [
                "decode",
                "--batch",
                "3",
                "--layers",
                "2",
                "--repeats",
                "2",
                "--num-blocks",
                "64",
                "--min-context",
                "5",
                "--max-context",
                "90",
                "--threads",
                "1",
                *hot,
            ]
        )
        assert set(res["times"]) == {"cpu", "cpu-fp16", "torch"} and all(
            len(ts) == 2 for ts in res["times"].values()
        )
        assert res["kv_bytes"]["cpu-fp16"] * 2 == res["kv_bytes"]["cpu"]
    assert "GB/s of K/V" in capsys.readouterr().out


def test_prompt_attention_benchmark_runs_and_checks_tiles_against_rows(capsys):
    """bench/attention.py prompt on short prompts (a smoke test: it checks results, never times
    them)."""
    from bench import attention as bench_attention

    res = bench_attention.main(
        ["prompt", "--lens", "20", "70", "--layers", "2", "--repeats", "2", "--threads", "1"]
    )
    assert list(res) == [20, 70] and all(
        set(ms) == {"rows", "tiles", "torch"} for ms in res.values()
    )
    assert "rows/tiles" in capsys.readouterr().out


def test_prompt_attention_benchmark_fails_when_tiles_differ_from_rows(monkeypatch):
    from bench import attention as bench_attention

    real = attention.paged_decode_attention_cpu
    monkeypatch.setattr(
        attention,
        "paged_decode_attention_cpu",
        lambda q, k, v, t, c, s, cu=None: real(q, k, v, t, c, s, cu) + (cu is not None) * 1e-6,
    )
    with pytest.raises(AssertionError, match="tiles differ from rows"):
        bench_attention.main(
            ["prompt", "--lens", "20", "--layers", "1", "--repeats", "1", "--threads", "1"]
        )
