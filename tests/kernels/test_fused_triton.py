"""The fused Triton kernels (RMSNorm with the residual add, SiLU-and-mul, rotary with the K/V
store) against their PyTorch paths under TRITON_INTERPRET=1, in fp32, fp16 and bf16, rotary at
head_dim 64/128/256 (tests/fused_cases.py, in a subprocess: an out-of-range load kills the
interpreter's process). Shapes are drawn fresh each run from a printed seed;
INFERLINE_KERNEL_SEED=<n> replays one."""

from __future__ import annotations

import pytest

from tests.kernels.test_kernels import SEED, run_script


@pytest.mark.parametrize("group", ["norm", "silu", "rope", "checks"])
def test_fused_triton_kernel_matches_torch(group):
    results = run_script("fused_cases.py", group)
    if group == "rope":  # every dtype at every head size
        assert {(r["name"].split()[1], r["name"].split()[2]) for r in results} == {
            (dt, f"d={d}") for dt in ("float32", "float16", "bfloat16") for d in (64, 128, 256)
        }, SEED
