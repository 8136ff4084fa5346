"""gpt-oss through the engine on the Triton kernels under the interpreter: the decode and prefill
attention with sinks and sliding windows, the fused-MoE kernel with the experts' biases and the
clamped SwiGLU kernel, and the fused elementwise kernels (as `auto` sets them up on CUDA), in a
tiny random model in fp32, give transformers' greedy tokens and logits at every step for the
longest prompt (past the window, in three chunks, the later two on cached context), and (make
test-full) the greedy tokens of three prompts batched through chunked prefill and decode
(tests/triton_engine_cases.py, in a subprocess: TRITON_INTERPRET must be set before triton is
imported)."""

from __future__ import annotations

import json

import pytest
import torch

from inferline.worker.engine.models.loader import synthetic_tokenizer
from tests.kernels.test_triton_engine import run_cases
from tests.unit.test_gpt_oss import hf_greedy, hf_model, prompts

NEW = 4


# make test runs the prompt alone on the interpreter (the suite's time budget); make test-full
# the batch too.
@pytest.mark.slow
@pytest.mark.parametrize("batched", [False, pytest.param(True, marks=pytest.mark.full)])
def test_gpt_oss_on_triton_kernels_equals_hf_generate(batched, tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path)
    synthetic_tokenizer(hf.config).save_pretrained(tmp_path)
    ids = prompts()
    scheduler = {"max_num_batched_tokens": 16, "enable_prefix_caching": False}
    alone = {"name": "alone", "scheduler": scheduler, "arrivals": {0: [["a", ids[0], NEW]]}}
    batch = {
        "name": "batched",
        "scheduler": scheduler,
        "arrivals": {0: [[f"r{i}", p, NEW] for i, p in enumerate(ids)]},
    }
    runs = [batch] if batched else [{**alone, "logits": True}]
    backends, run = run_cases(["smollm2"], json.dumps({"model": str(tmp_path), "runs": runs}))
    assert backends["backends"]["attention"] == "triton", backends
    assert backends["backends"]["fused_ops"] == "triton", backends
    if batched:
        want = {f"r{i}": hf_greedy(hf, p, NEW) for i, p in enumerate(ids)}
        assert run["tokens"] == want
        return
    alone = run
    assert alone["tokens"] == {"a": hf_greedy(hf, ids[0], NEW)}
    with torch.inference_mode():
        seq = torch.tensor([ids[0] + alone["tokens"]["a"][:-1]])
        hf_logits = hf(seq).logits[0, len(ids[0]) - 1 :]
    err = float((torch.tensor(alone["logits"]) - hf_logits).abs().max())
    assert err < 1e-3, f"logits differ from HF by {err}"
