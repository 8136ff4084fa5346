"""kernels/fused.py: each C kernel (csrc/fused_ops.c) against its PyTorch path on random shapes.

Shapes are drawn fresh each run from a printed seed; INFERLINE_KERNEL_SEED=<n> replays one.
"""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

from bench.roofline import in_thread
from inferline.kernels import fused

SEED = int(os.environ.get("INFERLINE_KERNEL_SEED", random.randrange(1 << 31)))

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="no C compiler: the engine uses the PyTorch path",
)

ROWS = [1, 2, 7, 29, 130, 513]  # one token up to a prefill chunk (the larger ones use every thread)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(SEED)


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(
        got, want, rtol=2e-6, atol=2e-6, msg=lambda m: f"seed {SEED}, {what}: {m}"
    )


def test_available_only_for_fp32_on_the_cpu():
    assert fused.available(torch.device("cpu"), torch.float32)
    assert not fused.available(torch.device("cpu"), torch.bfloat16)
    assert not fused.available(torch.device("cuda"), torch.float32)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(
    "cols", [576, 64, 100]
)  # SmolLM2's hidden size, a small one, not a multiple of 16
def test_rms_norm_matches_torch(gen, rows, cols):
    wide = torch.randn(rows, cols + 24, generator=gen) * 3
    x = wide[:, 5 : 5 + cols]  # rows apart, as a slice of a wider row is
    w = torch.randn(cols, generator=gen)
    close(
        fused.rms_norm(x, w, 1e-5, ops="c"), fused.rms_norm(x, w, 1e-5), f"rms_norm {rows}x{cols}"
    )


@pytest.mark.parametrize("rows", ROWS)
def test_fused_add_rms_norm_updates_the_residual_in_place(gen, rows):
    x, w = torch.randn(rows, 576, generator=gen), torch.randn(576, generator=gen)
    residual = torch.randn(rows, 576, generator=gen)
    want_out, want_residual = fused.fused_add_rms_norm(x, residual.clone(), w, 1e-6)
    out, new_residual = fused.fused_add_rms_norm(x, residual, w, 1e-6, ops="c")
    assert new_residual is residual, "the C path updates the residual stream in place"
    assert torch.equal(residual, want_residual), "x + residual is one rounding either way"
    close(out, want_out, f"fused_add_rms_norm rows {rows}")


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", [1536, 40])  # SmolLM2's; one not a multiple of 16
def test_silu_and_mul_matches_torch(gen, rows, inter):
    x = torch.randn(rows, 2 * inter, generator=gen) * 4
    x[0, :8] = torch.tensor(
        [-1000.0, -100.0, -88.0, -20.0, 0.0, 20.0, 89.0, 1000.0]
    )  # both ends of exp
    close(fused.silu_and_mul(x, ops="c"), fused.silu_and_mul(x), f"silu_and_mul {rows}x{inter}")


def rope_inputs(gen, tokens: int, heads: int, kv_heads: int, head_dim: int, num_blocks: int = 40):
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 6.28
    cos = torch.cat((angles.cos(), angles.cos()), -1).unsqueeze(1)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).unsqueeze(1)
    slots = torch.randperm(num_blocks * 16, generator=gen)[:tokens]
    slots[::5] = -1  # padding rows: rotated, never stored
    cache = torch.full((num_blocks, 16, kv_heads, head_dim), float("nan"))
    return qkv, cos, sin, slots, cache


@pytest.mark.parametrize("tokens", [1, 29, 300])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (4, 1, 48)])
def test_rope_store_kv_matches_torch(gen, tokens, heads, kv_heads, head_dim):
    qkv, cos, sin, slots, cache = rope_inputs(gen, tokens, heads, kv_heads, head_dim)
    k_want, v_want, k_got, v_got = (cache.clone() for _ in range(4))
    q_want = fused.rope_store_kv(qkv.clone(), heads, kv_heads, cos, sin, k_want, v_want, slots)
    q_got = fused.rope_store_kv(qkv, heads, kv_heads, cos, sin, k_got, v_got, slots, ops="c")
    close(q_got, q_want, "rotated q")
    assert q_got.data_ptr() == qkv.data_ptr(), "q is rotated in place in qkv"
    for got, want, name in ((k_got, k_want, "k cache"), (v_got, v_want, "v cache")):
        assert torch.equal(got.isnan(), want.isnan()), f"seed {SEED}: {name} written at other slots"
        close(got.nan_to_num(), want.nan_to_num(), name)


@pytest.mark.parametrize("tokens", [1, 29])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (4, 1, 40)])
def test_rope_store_kv_into_an_fp16_cache_matches_torch(gen, tokens, heads, kv_heads, head_dim):
    """The C store rounds to the nearest half as torch's .to(float16) does: each stored row equals
    the rotated fp32 row (left in qkv) rounded by torch, bit for bit, and the caches match the torch
    path's to its rounding (head_dim 40, not a multiple of 16, takes the torch path for the
    store)."""
    qkv, cos, sin, slots, cache = rope_inputs(gen, tokens, heads, kv_heads, head_dim)
    cache = cache.half()
    k_want, v_want, k_got, v_got = (cache.clone() for _ in range(4))
    q_want = fused.rope_store_kv(qkv.clone(), heads, kv_heads, cos, sin, k_want, v_want, slots)
    q_got = fused.rope_store_kv(qkv, heads, kv_heads, cos, sin, k_got, v_got, slots, ops="c")
    close(q_got, q_want, "rotated q")
    kv = qkv[:, heads * head_dim :].view(
        tokens, 2, kv_heads, head_dim
    )  # k rotated in place, v as given
    stored = slots >= 0
    for i, (got, want, name) in enumerate(((k_got, k_want, "k cache"), (v_got, v_want, "v cache"))):
        assert got.dtype == torch.float16
        assert torch.equal(got.isnan(), want.isnan()), f"seed {SEED}: {name} written at other slots"
        rows = got.view(-1, kv_heads, head_dim)[slots[stored]]
        if (
            head_dim % 16 == 0 or i == 1
        ):  # the C path's k (and any v) is the fp32 row in qkv, rounded
            assert torch.equal(rows, kv[stored, i].half()), (
                f"seed {SEED}: {name} rounded differently"
            )
        torch.testing.assert_close(
            got.nan_to_num().float(), want.nan_to_num().float(), rtol=1e-3, atol=1e-3
        )


def test_rope_store_kv_refuses_a_slot_past_the_cache(gen):
    qkv, cos, sin, slots, cache = rope_inputs(gen, 6, 9, 3, 64, num_blocks=2)
    slots = torch.tensor([0, 1, 2, 3, 4, 2 * 16])  # one past the last slot
    k, v, before = cache.clone(), cache.clone(), qkv.clone()
    with pytest.raises(RuntimeError, match="past the cache"):
        fused.rope_store_kv(qkv, 9, 3, cos, sin, k, v, slots, ops="c")
    assert k.isnan().all() and v.isnan().all() and torch.equal(qkv, before), (
        "checked before anything is written"
    )


def test_rows_do_not_depend_on_the_batch_or_the_threads(gen):
    """A row's result is the same alone, inside any batch, and on 1 or 2 threads (bitwise)."""
    x, w = torch.randn(513, 576, generator=gen), torch.randn(576, generator=gen)
    gate_up = torch.randn(513, 3072, generator=gen)

    def run():
        return (
            fused.rms_norm(x, w, 1e-5, ops="c"),
            fused.silu_and_mul(gate_up, ops="c"),
            [fused.rms_norm(x[i : i + 1], w, 1e-5, ops="c") for i in (0, 200, 512)],
            [fused.silu_and_mul(gate_up[i : i + 1], ops="c") for i in (0, 200, 512)],
        )

    one, two = in_thread(run, 1), in_thread(run, 2)
    for a, b in zip(one[:2], two[:2]):
        assert torch.equal(a, b), "thread count changed a result"
    for rows, full in ((two[2], two[0]), (two[3], two[1])):
        for row, i in zip(rows, (0, 200, 512)):
            assert torch.equal(row[0], full[i]), f"row {i} differs alone and in the batch"
