"""The engine on the Triton kernels, under the interpreter, against HF transformers.

What `auto` picks on CUDA (Triton: rotary with the K/V store, prefill and decode attention,
RMSNorm with the residual add, SiLU-and-mul, with the launch plans of an H200) runs here on the CPU
through the whole model and the engine: SmolLM2 in fp32 must give HF's greedy tokens through
chunked prefill, prompts on cached prefix blocks, decode across block boundaries and a preemption;
a Llama-shaped dummy model (head_dim 128, GQA 4) in bf16 must give the torch path's logits within
bf16 tolerance. The runs happen in a subprocess (tests/triton_engine_cases.py): TRITON_INTERPRET
must be set before triton is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.engine_fixtures import prompt_ids
from tests.worker_fixtures import topics  # noqa: F401 - a fixture

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 16  # Settings().cache.block_size, which the subprocess keeps


def run_cases(args: list[str], stdin: str = "") -> list[dict]:
    cmd = [sys.executable, str(ROOT / "tests" / "triton_engine_cases.py"), *args]
    proc = subprocess.run(
        cmd,
        input=stdin,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1500,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert proc.returncode == 0, (
        f"triton_engine_cases.py {args[0]} exited {proc.returncode}\n{proc.stderr[-4000:]}"
    )
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def hf_greedy(hf_model, ids: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        x = torch.tensor([ids])
        y = hf_model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return y[0, len(ids) :].tolist()


def blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK)


@pytest.mark.slow
def test_smollm2_on_triton_kernels_equals_hf_generate(
    model_runner, shallow_smollm2, shallow_hf_model
):
    """SmolLM2's first layers (shallow_smollm2: every step runs in the interpreter) on the Triton
    kernels through the engine: chunked prefill, the prefix cache and preemption give HF's tokens.
    Prompts end 2 tokens short of a block boundary, so 4 new tokens decode across it."""
    a = prompt_ids(model_runner.tokenizer, 0)[: 2 * BLOCK - 2]
    b = prompt_ids(model_runner.tokenizer, 2)[: BLOCK - 2]
    new = 4
    expected = {"a": hf_greedy(shallow_hf_model, a, new), "b": hf_greedy(shallow_hf_model, b, new)}
    cases = {
        "model": str(shallow_smollm2),
        "runs": [
            # a 16-token budget: a's prompt in two chunks, b's chunked beside a's decode; a2 is a's
            # prompt again, arriving while a runs: its full block comes from the prefix cache
            {
                "name": "chunked",
                "scheduler": {"max_num_batched_tokens": BLOCK},
                "arrivals": {0: [["a", a, new]], 1: [["b", b, new]], 2: [["a2", a, new]]},
            },
            # exactly the prompts' blocks: the first to need another block preempts the other
            {
                "name": "preempt",
                "scheduler": {"num_blocks": blocks(len(a)) + blocks(len(b))},
                "arrivals": {0: [["a", a, new], ["b", b, new]]},
            },
        ],
    }
    backends, chunked, preempt = run_cases(["smollm2"], json.dumps(cases))
    assert backends["backends"] == {
        "attention": "triton",
        "linear": "torch",
        "fused_ops": "triton",
        "triton_target": "interpreter",
    }
    assert chunked["tokens"] == {"a": expected["a"], "b": expected["b"], "a2": expected["a"]}
    assert chunked["prefix_cache_hits"] >= BLOCK
    assert preempt["tokens"] == expected and preempt["preemptions"] > 0


@pytest.mark.slow
@pytest.mark.full  # make test-full (the suite's budget): make test runs 16-token blocks
def test_smollm2_on_triton_kernels_with_32_token_blocks(
    model_runner, shallow_smollm2, shallow_hf_model
):
    """Pages of 32 (the decode tile then holds part of a page): a prompt of 30 tokens decodes
    across the first block boundary and gives HF's tokens."""
    ids = prompt_ids(model_runner.tokenizer, 1)[:30]
    expected = hf_greedy(shallow_hf_model, ids, 4)
    cases = {
        "model": str(shallow_smollm2),
        "block_size": 32,
        "runs": [{"name": "bs32", "arrivals": {0: [["a", ids, 4]]}}],
    }
    _, run = run_cases(["smollm2"], json.dumps(cases))
    assert run["tokens"] == {"a": expected}


@pytest.mark.slow
@pytest.mark.full  # make test-full (the suite's budget); bf16 kernels: test_kernels.py's groups
def test_llama_shaped_bf16_on_triton_kernels_matches_the_torch_path(tmp_path):
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=49152,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    (result,) = run_cases(["dummy-bf16", str(tmp_path)])
    assert result["steps_compared"] >= 2, result  # the prompt's step and at least one decode
    assert max(result["rel_errors"]) < 2e-2, result


@pytest.mark.full  # a worker process's start: make test-full (the suite's budget)
def test_worker_with_triton_on_a_cpu_without_the_interpreter_stops_at_start(tmp_path):
    """An explicit backend that cannot run here stops the worker at start-up with one line
    (exit code 2, a bad setting), before any request is taken."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERLINE_", "TRITON_"))}
    env.update(
        INFERLINE_MODEL__DEVICE="cpu",
        INFERLINE_MODEL__ATTENTION_BACKEND="triton",
        INFERLINE_KAFKA__BOOTSTRAP_SERVERS="127.0.0.1:1",
    )
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "inferline.worker"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("inferline-worker:")]
    assert "attention_backend=triton on the CPU needs TRITON_INTERPRET=1" in line
