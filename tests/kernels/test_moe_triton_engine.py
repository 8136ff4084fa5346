"""The MoE families through the engine on the Triton kernels under the interpreter: the fused-MoE
kernel (and the attention and fused elementwise kernels, as `auto` sets them up on CUDA) in a
tiny random Mixtral, Qwen3-MoE and Qwen2-MoE in fp32 give transformers' greedy tokens, two
prompts batched through chunked prefill and decode (tests/triton_engine_cases.py, in a
subprocess: TRITON_INTERPRET must be set before triton is imported)."""

from __future__ import annotations

import json

import pytest

from inferline.worker.engine.models.loader import synthetic_tokenizer
from tests.kernels.test_triton_engine import hf_greedy, run_cases
from tests.unit.test_moe import FAMILIES, SHAPE, hf_model, prompts

NEW = 4


# make test runs one family on the interpreter (the suite's time budget); make test-full all.
@pytest.mark.slow
@pytest.mark.parametrize(
    "family", [f if f == "mixtral" else pytest.param(f, marks=pytest.mark.full) for f in FAMILIES]
)
def test_moe_on_triton_kernels_equals_hf_generate(family, tmp_path):
    hf = hf_model(family, eos_token_id=None)  # no early stop: every request runs NEW tokens
    hf.save_pretrained(tmp_path)
    synthetic_tokenizer(hf.config).save_pretrained(tmp_path)
    a, b = prompts()[1], prompts()[3]
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
    assert backends["backends"]["fused_ops"] == "triton", backends
    assert run["tokens"] == {"a": hf_greedy(hf, a, NEW), "b": hf_greedy(hf, b, NEW)}, family


@pytest.mark.full  # 32 s on the interpreter: make test-full
def test_moe_warm_up_launches_every_binary_a_served_run_launches(tmp_path):
    """tests/warmup_cases.py on a dummy Mixtral: the served run's 600-token prompt takes the
    fused-MoE kernel's 64-row plan, its decodes the 16-row one; the warm-up must launch both."""
    from transformers import AutoConfig

    from tests.interpreted import run_cases as run_script

    AutoConfig.for_model(
        "mixtral", **{**SHAPE, "vocab_size": 1200, "max_position_embeddings": 2048},
        **FAMILIES["mixtral"], head_dim=16,
    ).save_pretrained(tmp_path)  # fmt: skip
    (result,) = run_script("warmup_cases.py", str(tmp_path), timeout=3000)
    assert "_fused_moe_kernel" in result["served_kernels"], result
    assert result["missing"] == [], result
