"""Kernels: the PyTorch reference against dense attention (in process), and the Triton kernels
against the reference under TRITON_INTERPRET=1 (in a subprocess: an out-of-range load kills
the interpreter's process; see tests/kernel_cases.py).

Shapes are drawn fresh each run from a printed seed; INFERLINE_KERNEL_SEED=<n> replays one.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inferline import kernels
from inferline.kernels import reference
from inferline.kernels.reference import dense_causal_attention
from inferline.kernels.triton.decode import MIN_SPLIT_TOKENS, plan_decode
from inferline.kernels.triton.launch import Target
from tests.paged_cache import PagedCache

ROOT = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("INFERLINE_KERNEL_SEED", random.randrange(1 << 31)))


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(SEED)


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


# --- the reference (the CPU production path) ---------------------------------------------


@pytest.mark.parametrize("gqa", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_reference_decode_matches_dense_attention(gen, gqa, block_size):
    lens = [1, block_size - 1, block_size + 1, int(torch.randint(150, 400, (1,), generator=gen))]
    cache = PagedCache(gen, lens, block_size, 2, 64, torch.float32)
    q = torch.randn(len(lens), 2 * gqa, 64, generator=gen)
    out = kernels.paged_decode_attention(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125
    )
    assert not out.isnan().any(), f"seed {SEED}: NaN from unused cache slots leaked"
    for i in range(len(lens)):
        dense = dense_causal_attention(q[i : i + 1], cache.k[i], cache.v[i], 0.125)
        assert rel_err(out[i : i + 1], dense) < 1e-5, f"seed {SEED}, seq {i}, len {lens[i]}"


@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("block_size", [8, 32])
def test_reference_prefill_matches_dense_attention(gen, gqa, block_size):
    # plain prefill, chunk on cached context, one-token chunk, a long chunk on a long context
    pairs = [(block_size - 1, block_size - 1), (block_size + 1, 3), (5, 1), (300, 70)]
    cache = PagedCache(gen, [c for c, _ in pairs], block_size, 2, 64, torch.float32)
    cu = torch.tensor(
        [0] + [sum(n for _, n in pairs[: i + 1]) for i in range(len(pairs))], dtype=torch.int32
    )
    q = torch.randn(int(cu[-1]), 2 * gqa, 64, generator=gen)
    out = kernels.paged_prefill_attention(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cu, cache.context_lens, 0.125
    )
    for i in range(len(pairs)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        dense = dense_causal_attention(q[rows], cache.k[i], cache.v[i], 0.125)
        assert rel_err(out[rows], dense) < 1e-5, f"seed {SEED}, seq {i}, (ctx, q_len) {pairs[i]}"


@pytest.mark.parametrize("window", [1, 7, 16, 33, 500])
def test_reference_sliding_window_matches_dense_attention(gen, window):
    """Keys p - window < j <= p (transformers' sliding_window_overlay) in decode and prefill."""
    lens = [1, 15, 17, 60, 300]
    cache = PagedCache(gen, lens, 16, 2, 64, torch.float32)
    q = torch.randn(len(lens), 8, 64, generator=gen)
    out = kernels.paged_decode_attention(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125,
        backend="torch", window=window,
    )  # fmt: skip
    for i in range(len(lens)):
        dense = dense_causal_attention(q[i : i + 1], cache.k[i], cache.v[i], 0.125, window)
        assert rel_err(out[i : i + 1], dense) < 1e-5, f"seed {SEED}, decode {i}, window {window}"
    q_lens = [1, 15, 3, 60, 70]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 8, 64, generator=gen)
    out = kernels.paged_prefill_attention(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cu, cache.context_lens, 0.125,
        backend="torch", window=window,
    )  # fmt: skip
    for i in range(len(lens)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        dense = dense_causal_attention(q[rows], cache.k[i], cache.v[i], 0.125, window)
        assert rel_err(out[rows], dense) < 1e-5, f"seed {SEED}, prefill {i}, window {window}"
    if window < 60:  # the window hides keys: not the causal result
        causal = dense_causal_attention(q[rows], cache.k[i], cache.v[i], 0.125)
        assert rel_err(out[rows], causal) > 1e-3


@pytest.mark.parametrize("window", [None, 9])
def test_reference_sinks_match_dense_attention(gen, window):
    """gpt-oss's attention sinks (softmax over [scores, sink], the sink's column dropped) in
    decode and prefill, alone and with a sliding window, equal transformers' eager attention
    (its sinks path) and the textbook attention; they change the result."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    lens, q_lens, scale = [1, 15, 40, 130], [1, 15, 3, 60], 0.125  # sinks weighty beside keys
    sinks = torch.randn(8, generator=gen) * 2 + 3
    cache = PagedCache(gen, lens, 16, 2, 64, torch.float32)
    q = torch.randn(len(lens), 8, 64, generator=gen)
    tables = (cache.k_cache, cache.v_cache, cache.block_tables)
    out = kernels.paged_decode_attention(
        q, *tables, cache.context_lens, scale, backend="torch", window=window, sinks=sinks
    )
    for i in range(len(lens)):
        dense = dense_causal_attention(
            q[i : i + 1], cache.k[i], cache.v[i], scale, window, 0, sinks
        )
        assert rel_err(out[i : i + 1], dense) < 1e-5, f"seed {SEED}, decode {i}"
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 8, 64, generator=gen)
    out = kernels.paged_prefill_attention(
        q, *tables, cu, cache.context_lens, scale, backend="torch", window=window, sinks=sinks
    )
    for i in range(len(lens)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        dense = dense_causal_attention(q[rows], cache.k[i], cache.v[i], scale, window, 0, sinks)
        assert rel_err(out[rows], dense) < 1e-5, f"seed {SEED}, prefill {i}"
    # transformers' eager attention on the last sequence, its mask made here
    ctx, q_len = lens[-1], q_lens[-1]
    pos_q, pos_k = torch.arange(ctx - q_len, ctx)[:, None], torch.arange(ctx)[None, :]
    hidden = (pos_k > pos_q) | (pos_k <= pos_q - window if window else False)
    mask = torch.zeros(hidden.shape).masked_fill(hidden, float("-inf"))[None, None]
    module = type("M", (), {"num_key_value_groups": 4, "sinks": sinks, "training": False})
    hf, _ = eager_attention_forward(
        module, q[rows].transpose(0, 1)[None], cache.k[i].transpose(0, 1)[None],
        cache.v[i].transpose(0, 1)[None], mask, scale,
    )  # fmt: skip
    assert rel_err(out[rows], hf[0]) < 1e-5, f"seed {SEED}: transformers' eager attention"
    plain = dense_causal_attention(q[rows], cache.k[i], cache.v[i], scale, window)
    assert rel_err(out[rows], plain) > 1e-2, "the sinks change nothing"


@pytest.mark.parametrize("window", [None, 9])
def test_reference_softcap_matches_dense_attention(gen, window):
    """Gemma 2's soft-capped scores (cap * tanh(s / cap)) in decode and prefill, alone and with a
    sliding window; a cap that bends the scores changes the result."""
    lens, q_lens, cap, scale = [1, 15, 40, 130], [1, 15, 3, 60], 2.0, 0.5
    cache = PagedCache(gen, lens, 16, 2, 64, torch.float32)
    q = torch.randn(len(lens), 8, 64, generator=gen)
    tables = (cache.k_cache, cache.v_cache, cache.block_tables)
    out = kernels.paged_decode_attention(
        q, *tables, cache.context_lens, scale, backend="torch", window=window, softcap=cap
    )
    for i in range(len(lens)):
        dense = dense_causal_attention(q[i : i + 1], cache.k[i], cache.v[i], scale, window, cap)
        assert rel_err(out[i : i + 1], dense) < 1e-5, f"seed {SEED}, decode {i}"
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 8, 64, generator=gen)
    out = kernels.paged_prefill_attention(
        q, *tables, cu, cache.context_lens, scale, backend="torch", window=window, softcap=cap
    )
    for i in range(len(lens)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        dense = dense_causal_attention(q[rows], cache.k[i], cache.v[i], scale, window, cap)
        assert rel_err(out[rows], dense) < 1e-5, f"seed {SEED}, prefill {i}"
    uncapped = dense_causal_attention(q[rows], cache.k[i], cache.v[i], scale, window)
    assert rel_err(out[rows], uncapped) > 1e-2


def test_reference_last_prefill_row_equals_decode(gen):
    cache = PagedCache(gen, [40, 9], 16, 2, 64, torch.float32)
    q = torch.randn(2, 8, 64, generator=gen)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    args = (cache.k_cache, cache.v_cache, cache.block_tables)
    pre = kernels.paged_prefill_attention(q, *args, cu, cache.context_lens, 0.1)
    dec = kernels.paged_decode_attention(q, *args, cache.context_lens, 0.1)
    assert rel_err(pre, dec) < 1e-6


def test_reference_decode_chunks_large_batches(gen, monkeypatch):
    cache = PagedCache(gen, [3, 100, 17, 64, 250], 16, 1, 64, torch.float32)
    q = torch.randn(5, 3, 64, generator=gen)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.1)
    whole = reference.paged_decode_attention(*args)
    monkeypatch.setattr(reference, "_DECODE_CHUNK_SEQS", 1)  # one sequence per chunk
    assert rel_err(reference.paged_decode_attention(*args), whole) < 1e-6


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-3), (torch.bfloat16, 1e-2)])
def test_reference_low_precision_close_to_fp32(gen, dtype, tol):
    cache = PagedCache(gen, [33, 200], 16, 2, 64, dtype)
    q = torch.randn(2, 8, 64, generator=gen).to(dtype)
    out = kernels.paged_decode_attention(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125
    )
    assert out.dtype == dtype
    for i in range(2):
        dense = dense_causal_attention(
            q[i : i + 1].float(), cache.k[i].float(), cache.v[i].float(), 0.125
        )
        assert rel_err(out[i : i + 1], dense) < tol


def test_reference_store_kv_writes_slots_and_skips_negative(gen):
    k_cache = torch.full((4, 8, 2, 16), float("nan"))
    v_cache = k_cache.clone()
    k, v = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    slots = torch.tensor([3, -1, 31, 8, -1])
    kernels.store_kv(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(32, 2, 16), v_cache.view(32, 2, 16)
    assert torch.equal(flat_k[[3, 31, 8]], k[[0, 2, 3]]) and torch.equal(
        flat_v[[3, 31, 8]], v[[0, 2, 3]]
    )
    assert flat_k.isnan().all(-1).all(-1).sum() == 29, "a skipped or foreign slot was written"
    kernels.store_kv(k[:0], v[:0], k_cache, v_cache, slots[:0])  # empty batch is a no-op


def test_auto_backend_on_cpu_is_torch_without_the_compiled_kernel(gen, monkeypatch):
    # (with it, fp32 decode goes to kernels/cpu/: tests/kernels/test_cpu_kernels.py)
    monkeypatch.setattr(kernels.cpu.build, "available", lambda: False)
    calls = []
    monkeypatch.setattr(
        reference, "paged_decode_attention", lambda *a, **kw: calls.append("decode")
    )
    monkeypatch.setattr(reference, "store_kv", lambda *a: calls.append("store"))
    q, cache = torch.randn(1, 2, 16), torch.empty(4, 16, 2, 16)  # a shape the C kernel takes
    kernels.paged_decode_attention(q, cache, cache, None, None, 1.0)
    kernels.store_kv(q, q, None, None, None, backend="torch")
    assert calls == ["decode", "store"]
    with pytest.raises(AssertionError):
        kernels.paged_decode_attention(q, cache, cache, None, None, 1.0, backend="cuda")


# --- the Triton kernels under the interpreter ---------------------------------------------


def run_cases(group: str) -> list[dict]:
    return run_script("kernel_cases.py", group)


def run_script(script: str, group: str) -> list[dict]:
    """tests/<script> GROUP SEED under the interpreter: its JSON lines, each case ok."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(ROOT / "tests" / script), group, str(SEED)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in results if not r["ok"]]
    report = "\n".join(json.dumps(r) for r in failed)
    assert proc.returncode == 0, (
        f"seed {SEED}: {script} {group} exited {proc.returncode} after {len(results)} cases "
        f"(-11 is an out-of-range load)\n{report}\n{proc.stderr[-4000:]}"
    )
    assert results and not failed, f"seed {SEED} (INFERLINE_KERNEL_SEED={SEED} replays):\n{report}"
    return results


@pytest.mark.parametrize(
    "group",
    [
        *("store", "checks", "decode", "prefill", "window", "softcap", "sinks"),
        pytest.param("split_len", marks=pytest.mark.full),  # make test-full: the suite's budget
    ],
)
def test_triton_kernel_matches_reference(group):
    run_cases(group)


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("group", ["decode_full", "prefill_full"])
def test_triton_kernel_full_matrix(group):
    """Every dtype x GQA ratio x block size (36 cases per kernel); `make test` runs every value of
    every axis (test_triton_kernel_matches_reference), `make test-full` this cross product too."""
    run_cases(group)


# --- the decode split length, chosen per step (pure: no kernel runs) ----------------------------

H200 = Target(90, 132)


@pytest.mark.parametrize(
    "num_seqs,table_tokens,grid_splits,old_working,new_working",
    [
        (64, 4096, 2, 1, 2),  # the case: a 2k context on 4096-token tables
        (16, 4096, 5, 3, 5),  # a mid batch
        (64, 32768, 2, 1, 2),  # a long max_model_len
    ],
)
def test_split_len_keeps_the_grid_busy_on_a_2k_context(
    num_seqs, table_tokens, grid_splits, old_working, new_working
):
    """Llama-3-8B's shapes on an H200: the grid's split count is sized for the table; the step's
    split length for a 2k context, so every split of the grid works."""
    plan = plan_decode(num_seqs, 32, 8, 128, 16, table_tokens // 16, torch.bfloat16, H200)
    split_len = plan.split_len_for(2048)
    assert plan.num_splits == grid_splits
    assert -(-2048 // plan.split_len) == old_working  # the table's split length
    assert -(-2048 // split_len) == new_working


def test_split_len_covers_the_longest_context_in_the_grid(gen):
    """Random plans and steps: the splits of the step's length cover its longest context within
    the grid, in whole tiles; one split when it fits; the table's own length at full width."""

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    for _ in range(500):
        num_rows, kv_heads = draw(1, 256), draw(1, 8)
        head_dim, block_size = (64, 80, 128, 256)[draw(0, 3)], 16
        width = draw(1, 2048)
        plan = plan_decode(num_rows, kv_heads, kv_heads, head_dim, block_size, width,
                           torch.float16, H200)  # fmt: skip
        longest = draw(0, width * block_size)
        num_seqs = draw(1, num_rows)  # padding rows: a bucket's
        split_len = plan.split_len_for(longest, num_seqs)
        case = (num_rows, kv_heads, head_dim, width, longest, num_seqs, split_len)
        assert split_len % plan.stage1.constexpr("BLOCK_N") == 0, case
        assert longest <= plan.num_splits * split_len, case
        if longest < 2 * MIN_SPLIT_TOKENS:
            assert longest <= split_len, case  # one split: no stage 2 work
        assert plan.split_len_for(width * block_size) == plan.split_len, case
