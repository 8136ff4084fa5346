"""What one decoder layer launches on the CUDA path, counted on the CPU under the interpreter.

    python tests/layer_launch_cases.py      one JSON line per step kind: its launches, in order

Triton launches are counted where every launcher launches (kernels.triton.launch.launch); every
other kernel a GPU would run is a PyTorch op, counted by a TorchDispatchMode: each op that is not
a view or an allocation is at least one CUDA kernel, and `_local_scalar_dense` (.item(), int())
is a device sync. The layer is set up as `auto` sets it up on CUDA (Triton attention and fused
ops, F.linear), the range checks off as they are on CUDA (INFERLINE_KERNEL_CHECKS=0).
tests/kernels/test_layer_launches.py runs this in a subprocess: TRITON_INTERPRET is set first.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"
os.environ["INFERLINE_KERNEL_CHECKS"] = "0"
# As a script its folder (tests/, which holds a `kernels` package) comes first on the path: drop
# it, and find `tests` after site-packages (where Hugging Face's `kernels` and inferline live).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.append(os.path.dirname(_HERE))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from inferline.kernels.attention import StepTables, TritonAttention  # noqa: E402
from inferline.kernels.triton import launch  # noqa: E402
from inferline.worker.engine.models.llama import DecoderLayer, RotaryEmbedding  # noqa: E402

aten = torch.ops.aten
FREE = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
}  # allocations: no kernel
BLOCK, NUM_BLOCKS, MAX_BLOCKS = (
    16,
    64,
    128,
)  # a 2,048-token table: the decode plan splits (two launches)
CONFIG = SimpleNamespace(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    rms_norm_eps=1e-5,
    model_type="llama",
    attention_bias=False,
)


class Launches(TorchDispatchMode):
    """Records each PyTorch op that runs a kernel, outside the Triton launches themselves."""

    def __init__(self, log: list[str]):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            not launch.launching()
            and func not in FREE
            and (not func.is_view or copied(args[0], out))
        ):
            self.log.append(
                "sync" if func is aten._local_scalar_dense.default else f"torch:{func.__name__}"
            )
        return out


def copied(source, out) -> bool:
    """An op that may return a view (`to` a dtype) and made a copy: a kernel."""
    return (
        isinstance(out, torch.Tensor)
        and out.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
    )


def step(chunks: list[tuple[int, int]], num_decodes: int) -> StepTables:
    """(num_computed, num_new) per sequence, decodes first; sequence i owns blocks i*8 .. i*8+7."""
    slots, positions, cu = [], [], [0]
    for i, (start, new) in enumerate(chunks):
        positions += range(start, start + new)
        slots += [(i * 8 + p // BLOCK) * BLOCK + p % BLOCK for p in range(start, start + new)]
        cu.append(cu[-1] + new)
    tables = torch.zeros(len(chunks), MAX_BLOCKS, dtype=torch.int32)
    for i in range(len(chunks)):
        tables[i, :8] = torch.arange(i * 8, i * 8 + 8)
    return StepTables(
        torch.tensor(slots),
        torch.tensor(positions),
        torch.tensor([a + n for a, n in chunks], dtype=torch.int32),
        torch.tensor(cu, dtype=torch.int32),
        num_decodes,
        lambda first, stop: tables[first:stop],
    )


def count(
    layer,
    rope_table,
    kind: str,
    tables: StepTables,
    fused_ops: str = "triton",
    dtype: torch.dtype = torch.float32,
) -> dict:
    backend = TritonAttention(BLOCK, CONFIG.num_key_value_heads, CONFIG.head_dim)
    meta = backend.prepare(tables, fused_ops=fused_ops)
    num_tokens = tables.positions.shape[0]
    hidden, residual = (torch.randn(num_tokens, CONFIG.hidden_size, dtype=dtype) for _ in range(2))
    k_cache, v_cache = (
        torch.zeros(NUM_BLOCKS, BLOCK, CONFIG.num_key_value_heads, CONFIG.head_dim, dtype=dtype)
        for _ in range(2)
    )
    rope = rope_table.tables(tables.positions)  # once a forward, for every layer: not the layer's
    log: list[str] = []
    launch.OBSERVERS.append(
        lambda kernel, plan, args: log.append(f"triton:{plan.kernel.strip('_')}")
    )
    try:
        with torch.inference_mode(), Launches(log):
            out, _ = layer(rope, hidden, residual, k_cache, v_cache, meta)
    finally:
        launch.OBSERVERS.clear()
    return {"kind": kind, "launches": log, "finite": bool(out.isfinite().all())}


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    layer = DecoderLayer(CONFIG)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    rope_table = RotaryEmbedding(
        CONFIG.head_dim, MAX_BLOCKS * BLOCK, {"rope_theta": 10000.0, "rope_type": "default"}
    )
    decode = [(30, 1), (60, 1), (7, 1), (100, 1)]
    for kind, chunks, nd in (
        ("decode", decode, 4),
        ("prefill", [(0, 20), (16, 9)], 0),
        ("mixed", [(30, 1), (60, 1), (0, 20)], 2),
    ):
        print(json.dumps(count(layer, rope_table, kind, step(chunks, nd))), flush=True)
    # in bf16, as served, and with the elementwise ops as PyTorch ops (the CUDA path before #39)
    layer.to(torch.bfloat16)
    rope_table.to(torch.bfloat16)
    print(
        json.dumps(count(layer, rope_table, "decode-bf16", step(decode, 4), dtype=torch.bfloat16)),
        flush=True,
    )
    print(
        json.dumps(
            count(
                layer, rope_table, "decode-bf16-torch-ops", step(decode, 4), "torch", torch.bfloat16
            )
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
