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
    """One process for both groups (the suite's time budget): 9 random e4m3 products, 3 on
    uint8 levels with offsets, 6 checks."""
    results = run_script("fp8_cases.py", "all")
    linear = [r for r in results if r["name"].startswith("linear[")]
    assert len(linear) == 9 and len(results) == 18, results  # both row tiles in every dtype


# make test-full: 35 s each on the interpreter (the suite's budget); make test runs the CPU case
# (tests/unit/test_fp8.py) and the kernel cases above.
@pytest.mark.slow
@pytest.mark.parametrize(
    "family, fmt",
    [pytest.param(f, fmt, marks=pytest.mark.full) for f in ("llama", "qwen3") for fmt in FORMATS]
    + [pytest.param("qwen3_moe", "fp8-block", marks=pytest.mark.full)],
)
def test_fp8_checkpoint_on_the_w8a16_kernel_equals_hf_generate(family, fmt, tmp_path):
    """The engine as `auto` sets it up on CUDA, under the interpreter: the decoder's linear layers
    keep their FP8 codes and scales and run on the W8A16 kernel, a Qwen3-MoE's experts on the
    fused-MoE kernel's W8A16 variant (attention and the fused ops on Triton too); two prompts
    batched through chunked prefill and decode give transformers' greedy tokens on the
    dequantized weights."""
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
    per_layer = 4  # qkv, o, then gate_up and down, or the experts' stacked w13 and w2
    assert backends["fp8_weights"] == per_layer * layers, backends
    assert backends["backends"]["fused_ops"] == "triton", backends
    assert run["tokens"] == {"a": hf_greedy(hf, a, NEW), "b": hf_greedy(hf, b, NEW)}, (family, fmt)


@pytest.mark.full  # a 600-token prompt on the interpreter: make test-full
def test_fp8_warm_up_launches_every_w8a16_binary_a_served_run_launches(tmp_path):
    """tests/warmup_cases.py on an FP8 (per block) Llama: the served run's prompt chunks take the
    W8A16 kernel's 64-row plan, its decodes the 16-row one; the warm-up must launch both."""
    from tests.interpreted import run_cases as run_script

    hf = hf_model("llama", vocab_size=1200, max_position_embeddings=2048)
    write_checkpoint(hf, "fp8-block", tmp_path)
    (result,) = run_script("warmup_cases.py", str(tmp_path), "auto", timeout=3000)
    assert "_w8a16_kernel" in result["served_kernels"], result
    assert result["missing"] == [], result
