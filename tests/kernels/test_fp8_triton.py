"""The Triton W8A16 kernel (FP8 e4m3 weight codes, per-row or per-block scales, fp32 sum) against
its PyTorch reference under TRITON_INTERPRET=1, in fp32, fp16 and bf16, decode- and prefill-sized
(tests/fp8_cases.py, in a subprocess). Shapes are drawn fresh each run from a printed seed;
INFERLINE_KERNEL_SEED=<n> replays one. Then FP8 checkpoints (tests/fp8_checkpoints.py) through the
engine on that kernel (tests/triton_engine_cases.py, in a subprocess)."""

from __future__ import annotations

import json

import pytest

from tests.fp8_checkpoints import FORMATS, hf_model, prompts, write_checkpoint
from tests.kernels.test_kernels import run_script
from tests.kernels.test_triton_engine import hf_greedy, run_cases

NEW = 4


def test_w8a16_kernel_matches_torch():
    """One process for both groups (the suite's time budget): 9 random products, 5 checks."""
    results = run_script("fp8_cases.py", "all")
    linear = [r for r in results if r["name"].startswith("linear[")]
    assert len(linear) == 9 and len(results) == 14, results  # both row tiles in every dtype


# make test-full: 35 s each on the interpreter (the suite's budget); make test runs the CPU case
# (tests/unit/test_fp8.py) and the kernel cases above.
@pytest.mark.slow
@pytest.mark.parametrize(
    "family, fmt",
    [pytest.param(f, fmt, marks=pytest.mark.full) for f in ("llama", "qwen3") for fmt in FORMATS],
)
def test_fp8_checkpoint_on_the_w8a16_kernel_equals_hf_generate(family, fmt, tmp_path):
    """The engine as `auto` sets it up on CUDA, under the interpreter: the decoder's linear layers
    keep their FP8 codes and scales and run on the W8A16 kernel (attention and the fused ops on
    Triton too); two prompts batched through chunked prefill and decode give transformers' greedy
    tokens on the dequantized weights."""
    hf = hf_model(family)
    write_checkpoint(hf, fmt, tmp_path)  # hf now holds the dequantized weights
    a, b = prompts()[1], prompts()[0]
    cases = {
        "model": str(tmp_path),
        "runs": [
            {
                "name": "batched",
                "scheduler": {"max_num_batched_tokens": 16},
                "arrivals": {0: [["a", a, NEW], ["b", b, NEW]]},
            }
        ],
    }
    backends, run = run_cases(["smollm2"], json.dumps(cases))
    layers = hf.config.num_hidden_layers
    assert backends["fp8_weights"] == 4 * layers, backends  # qkv, o, gate_up, down: codes
    assert backends["backends"]["fused_ops"] == "triton", backends
    assert run["tokens"] == {"a": hf_greedy(hf, a, NEW), "b": hf_greedy(hf, b, NEW)}, (family, fmt)
