"""The Triton fused-MoE kernel against its PyTorch reference under TRITON_INTERPRET=1, in fp32,
fp16 and bf16, decode-sized and prefill-sized (tests/moe_cases.py, in a subprocess); its W8A16
variant on FP8 e4m3 experts (a scale per row, per 16 or per 32 columns) against the reference on
the dequantized experts. Shapes are drawn fresh each run from a printed seed;
INFERLINE_KERNEL_SEED=<n> replays one."""

from __future__ import annotations

import pytest

from tests.kernels.test_kernels import run_script


@pytest.mark.parametrize("group", ["experts", "fp8", "gpt_oss", "checks"])
def test_fused_moe_kernel_matches_torch(group):
    """gpt_oss: the variant with the experts' biases and the clamped SwiGLU."""
    results = run_script("moe_cases.py", group)
    # both block sizes in every dtype; fp8: with each scale layout
    cases = {"experts": 6, "gpt_oss": 6, "fp8": 9}
    if group in cases:
        assert len(results) == cases[group], results
