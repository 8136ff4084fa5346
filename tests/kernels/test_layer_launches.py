"""The launches of one decoder layer on the CUDA path, counted (not timed) on the CPU: the
layer as `auto` sets it up on CUDA runs under the interpreter in a subprocess
(tests/layer_launch_cases.py) that records each Triton launch where every launcher launches and
each PyTorch op that would be a CUDA kernel. A decode step is at most 10 launches: 4 GEMMs, 2
RMSNorms with the residual add, rotary with the K/V store, SiLU-and-mul, the decode kernel's
one or two stages; none is a device sync."""

from __future__ import annotations

import pytest

from tests.interpreted import run_cases

GEMMS = ["torch:linear.default"] * 4  # qkv, o, gate_up, down


@pytest.fixture(scope="module")
def counts() -> dict[str, dict]:
    return {r["kind"]: r for r in run_cases("layer_launch_cases.py")}


def test_a_decode_step_is_at_most_10_launches_per_layer(counts):
    decode = counts["decode"]
    assert decode["finite"]
    assert decode["launches"] == [
        "triton:rms_norm_kernel",
        GEMMS[0],
        "triton:rope_store_kv_kernel",
        "triton:decode_stage1_kernel",
        "triton:decode_stage2_kernel",
        GEMMS[1],
        "triton:rms_norm_kernel",
        GEMMS[2],
        "triton:silu_and_mul_kernel",
        GEMMS[3],
    ], decode
    assert len(decode["launches"]) <= 10


def test_prompts_and_mixed_steps_add_only_the_prefill_kernel(counts):
    prefill, mixed = counts["prefill"]["launches"], counts["mixed"]["launches"]
    assert len(prefill) == 9 and prefill.count("triton:prefill_kernel") == 1, prefill
    # decodes and prompt chunks write their rows of one output: no concatenation
    assert (
        mixed
        == counts["decode"]["launches"][:5]
        + ["triton:prefill_kernel"]
        + counts["decode"]["launches"][5:]
    )
    assert all("sync" not in r["launches"] for r in counts.values()), counts


def test_the_fused_kernels_replace_most_launches(counts):
    """In bf16 as served: the same launches; the elementwise ops as PyTorch ops were 33 (3.3x)."""
    assert counts["decode-bf16"]["launches"] == counts["decode"]["launches"]
    torch_ops = counts["decode-bf16-torch-ops"]["launches"]
    assert len(torch_ops) >= 30 and "sync" not in torch_ops, torch_ops  # 33 with torch 2.x
