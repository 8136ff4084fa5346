"""Attention backends as objects (kernels/attention.py): each prepares its own step metadata and
computes what kernels/reference.py computes; the runner makes one at load and every step's
metadata carries that one object."""

from __future__ import annotations

import pytest
import torch

from inferline.kernels import reference
from inferline.kernels.attention import (
    BACKENDS,
    CpuAttention,
    StepTables,
    TokenMetadata,
    TorchAttention,
    TritonAttention,
    make_attention,
)
from inferline.kernels.cpu import build

BLOCK, KV_HEADS, HEADS, DIM, NUM_BLOCKS = 16, 2, 4, 64, 12
# (num_computed, num_new) per sequence, decodes first; block tables are disjoint runs of blocks
CHUNKS = [(19, 1), (32, 1), (16, 5), (0, 7)]
TABLES = [[3, 4], [0, 1, 2], [5, 6], [9]]


def step_tables() -> StepTables:
    slots, positions, cu = [], [], [0]
    for (start, new), table in zip(CHUNKS, TABLES):
        positions += range(start, start + new)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + new)]
        cu.append(cu[-1] + new)

    def block_tables(first, stop):
        rows = TABLES[first:stop]
        width = max(map(len, rows))
        return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)

    return StepTables(
        torch.tensor(slots),
        torch.tensor(positions),
        torch.tensor([a + n for a, n in CHUNKS], dtype=torch.int32),
        torch.tensor(cu, dtype=torch.int32),
        2,
        block_tables,
    )


def expected(q, k_cache, v_cache, step: StepTables) -> torch.Tensor:
    decode = reference.paged_decode_attention(
        q[:2], k_cache, v_cache, step.block_tables(0, 2), step.context_lens[:2], 0.125
    )
    cu = step.cu_seqlens_q[2:] - 2
    prefill = reference.paged_prefill_attention(
        q[2:], k_cache, v_cache, step.block_tables(2, 4), cu, step.context_lens[2:], 0.125
    )
    return torch.cat((decode, prefill))


@pytest.mark.parametrize("name", ["torch", "cpu"])
def test_each_backend_computes_the_reference(name):
    if name == "cpu" and not build.available():
        pytest.skip("the C kernels did not build")
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (
        torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, DIM, generator=gen) for _ in range(2)
    )
    step = step_tables()
    num_tokens = step.slot_mapping.shape[0]
    q = torch.randn(num_tokens, HEADS, DIM, generator=gen)
    backend = make_attention(name, BLOCK, KV_HEADS)
    meta = backend.prepare(step)
    assert (
        meta.backend is backend
        and meta.num_decode_tokens == 2
        and meta.slot_mapping is step.slot_mapping
    )
    torch.testing.assert_close(
        backend.forward(q, k_cache, v_cache, meta, 0.125),
        expected(q, k_cache, v_cache, step),
        rtol=1e-5,
        atol=1e-5,
    )


def test_each_backend_owns_its_metadata():
    step = step_tables()
    torch_meta = TorchAttention(BLOCK, KV_HEADS).prepare(step)
    assert torch_meta.decode_plan is not None and torch_meta.prefill_cu_seqlens_q.tolist() == [
        0,
        5,
        12,
    ]
    cpu_meta = CpuAttention(BLOCK, KV_HEADS).prepare(step, fused_ops="c")
    assert isinstance(cpu_meta, TokenMetadata) and cpu_meta.fused_ops == "c"
    assert cpu_meta.context_lens.tolist() == [
        p + 1 for p in step.positions.tolist()
    ]  # a row per token
    assert cpu_meta.block_tables.shape == (4, 3)


def test_names_and_classes():
    assert {name: cls for name, cls in BACKENDS.items()} == {
        "triton": TritonAttention,
        "cpu": CpuAttention,
        "torch": TorchAttention,
    }
    with pytest.raises(AssertionError, match="auto"):
        make_attention("auto", BLOCK, KV_HEADS)  # resolved once, by kernels.backends, never here


TRITON_CASE = """
import torch
from inferline.kernels.attention import make_attention
from tests.kernels.test_attention_backends import (
    BLOCK, DIM, HEADS, KV_HEADS, NUM_BLOCKS, expected, step_tables,
)
gen = torch.Generator().manual_seed(0)
k_cache, v_cache = (torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, DIM, generator=gen) for _ in range(2))
step = step_tables()
backend = make_attention("triton", BLOCK, KV_HEADS, DIM)
k, v = (torch.randn(step.slot_mapping.shape[0], KV_HEADS, DIM, generator=gen) for _ in range(2))
want_k, want_v = k_cache.clone(), v_cache.clone()
make_attention("torch", BLOCK, KV_HEADS).store_kv(k, v, want_k, want_v, step.slot_mapping)
backend.store_kv(k, v, k_cache, v_cache, step.slot_mapping)
assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
q = torch.randn(step.slot_mapping.shape[0], HEADS, DIM, generator=gen)
meta = backend.prepare(step)
torch.testing.assert_close(backend.forward(q, k_cache, v_cache, meta, 0.125),
                           expected(q, k_cache, v_cache, step), rtol=1e-4, atol=1e-4)
print("triton ok")
"""


@pytest.mark.kernels
def test_the_triton_backend_computes_the_reference_under_the_interpreter():
    """Its metadata (decode rows, prompt chunks' cu_seqlens rebased to 0) fits its kernels: a
    mixed step under TRITON_INTERPRET=1, in a subprocess (set before triton is imported)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_CASE],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=900,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert proc.returncode == 0 and "triton ok" in proc.stdout, proc.stderr[-3000:]
