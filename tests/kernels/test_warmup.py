"""No compiles mid-serving: start-up warm-up (worker/engine/warmup.py) launches every Triton
binary a served run then launches. Under the interpreter in a subprocess (tests/warmup_cases.py):
each launch of the warm-up and of a served run is named by the binary it runs (its constexprs,
compile options and the JIT's specialization of every other argument: kernels/triton/variants.py),
and the run's must all be the warm-up's."""

from __future__ import annotations

import json

import pytest
import torch

from inferline.kernels.triton.decode import plan_decode
from inferline.kernels.triton.launch import Target
from tests.interpreted import run_cases
from inferline.worker.engine.warmup import decode_shapes

CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    vocab_size=49152,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
)


@pytest.mark.full  # ~55 s on the interpreter: make test-full (the suite's budget)
def test_every_binary_a_served_run_launches_was_warmed(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (result,) = run_cases("warmup_cases.py", str(tmp_path), timeout=3000)
    assert result["missing"] == [], result
    # the run was a real test: prompt chunks, direct and split decode, every layer kernel
    assert result["served_splits"] == [2] and result["direct_served"], result
    assert set(result["served_kernels"]) >= {
        "_decode_stage1_kernel",
        "_decode_stage2_kernel",
        "_prefill_kernel",
        "_rms_norm_kernel",
        "_rope_store_kv_kernel",
        "_silu_and_mul_kernel",
    }
    assert result["kv_untouched"], "warm-up wrote K/V"


def test_decode_shapes_cover_every_decode_plan_of_the_settings():
    """Against plan_decode over every batch size and table width the settings allow."""
    target = Target(90, 132)
    shapes = decode_shapes(8, 128, 16, 2048 // 16, 64, target)

    def key(num_seqs, width):
        plan = plan_decode(num_seqs, 32, 8, 128, 16, width, torch.bfloat16, target)
        return plan.stage1.constexprs, plan.stage2.constexprs if plan.stage2 else None

    every = {key(n, w) for n in range(1, 65) for w in range(1, 2048 // 16 + 1)}
    assert {key(s.num_seqs, s.width) for s in shapes} == every
    assert (
        len(shapes) == len(every) == 4
    )  # direct, and SPLITS_P2 2, 4, 8 (splits of 256+ tokens) at 2k context
