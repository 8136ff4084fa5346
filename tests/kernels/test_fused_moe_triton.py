"""The Triton fused-MoE kernel against its PyTorch reference under TRITON_INTERPRET=1, in fp32,
fp16 and bf16, decode-sized and prefill-sized (tests/moe_cases.py, in a subprocess). Shapes are
drawn fresh each run from a printed seed; INFERLINE_KERNEL_SEED=<n> replays one."""

from __future__ import annotations

import pytest

from tests.kernels.test_kernels import run_script


@pytest.mark.parametrize("group", ["experts", "gpt_oss", "checks"])
def test_fused_moe_kernel_matches_torch(group):
    """gpt_oss: the variant with the experts' biases and the clamped SwiGLU."""
    results = run_script("moe_cases.py", group)
    if group != "checks":  # both block sizes in every dtype
        assert len(results) == 6, results
