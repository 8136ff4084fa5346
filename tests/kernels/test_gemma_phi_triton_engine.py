"""Gemma 2, Gemma 3 and a Phi-4-mini-like Phi-3 through the engine on the Triton kernels under the
interpreter: the soft-capped Triton decode and prefill attention, with sliding windows, and the
fused elementwise kernels (as `auto` sets them up on CUDA) in tiny random models in fp32 give
transformers' greedy tokens, three prompts (all past the window) batched through chunked prefill
and decode, and HF's logits at every step of the longest alone (tokens alone miss a soft-cap
left out of the decode kernel) (tests/triton_engine_cases.py, in a subprocess: TRITON_INTERPRET
must be set before triton is imported)."""

from __future__ import annotations

import json

import pytest
import torch

from inferline.worker.engine.models.loader import synthetic_tokenizer
from tests.kernels.test_triton_engine import run_cases
from tests.unit.test_gemma_phi import configs, hf_greedy, hf_model, prompts

NEW = 4


# make test-full (the suite's time budget): make test runs the soft-cap and window kernels'
# cases (test_kernels.py) and gpt-oss's windowed layers on the interpreter.
@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("family", list(configs()))
def test_family_on_triton_kernels_equals_hf_generate(family, tmp_path):
    hf = hf_model(family)
    hf.save_pretrained(tmp_path)
    synthetic_tokenizer(hf.config).save_pretrained(tmp_path)
    ids = prompts()
    cases = {
        "model": str(tmp_path),
        "runs": [
            {
                "name": "batched",
                "scheduler": {"max_num_batched_tokens": 16, "enable_prefix_caching": False},
                "arrivals": {0: [[f"r{i}", p, NEW] for i, p in enumerate(ids)]},
            },
            {
                "name": "alone",
                "scheduler": {"max_num_batched_tokens": 16, "enable_prefix_caching": False},
                "arrivals": {0: [["a", ids[0], NEW]]},
                "logits": True,
            },
        ],
    }
    backends, run, alone = run_cases(["smollm2"], json.dumps(cases))
    assert backends["backends"]["attention"] == "triton", backends
    assert backends["backends"]["fused_ops"] == "triton", backends
    want = {f"r{i}": hf_greedy(hf, p, NEW) for i, p in enumerate(ids)}
    assert run["tokens"] == want, family
    with torch.inference_mode():
        seq = torch.tensor([ids[0] + alone["tokens"]["a"][:-1]])
        hf_logits = hf(seq).logits[0, len(ids[0]) - 1 :]
    err = float((torch.tensor(alone["logits"]) - hf_logits).abs().max())
    assert err < 1e-3, f"{family}: logits differ from HF by {err}"
