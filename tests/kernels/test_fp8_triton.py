"""The Triton W8A16 kernel (FP8 e4m3 weight codes, per-row or per-block scales, fp32 sum) against
its PyTorch reference under TRITON_INTERPRET=1, in fp32, fp16 and bf16, decode- and prefill-sized
(tests/fp8_cases.py, in a subprocess). Shapes are drawn fresh each run from a printed seed;
INFERLINE_KERNEL_SEED=<n> replays one."""

from __future__ import annotations

from tests.kernels.test_kernels import run_script


def test_w8a16_kernel_matches_torch():
    """One process for both groups (the suite's time budget): 9 random products, 5 checks."""
    results = run_script("fp8_cases.py", "all")
    linear = [r for r in results if r["name"].startswith("linear[")]
    assert len(linear) == 9 and len(results) == 14, results  # both row tiles in every dtype
