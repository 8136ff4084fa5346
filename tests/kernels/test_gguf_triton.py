"""A GGUF checkpoint through the engine with its exact uint8 levels kept as codes for the W8A16
Triton kernel (the default on CUDA), under the interpreter: a tiny random Llama (make test), a
Qwen2 (q/k/v biases, tied embeddings) and a wider tied Llama (head_dim 64) (make test-full),
written as real GGUF files (tests/gguf_checkpoints.py: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q6_K and F16
projections, Q8_0 embeddings, SmolLM2's tokenizer cut short). Two prompts batched through
chunked prefill and decode give, with the codes, the tokens and logits of the same file
dequantized (INFERLINE_MODEL__GPU_WEIGHT_CODES=off; make test-full) and of transformers loading
the GGUF; the layers the loader keeps as codes are exactly those whose every tensor is in a
legacy 32-value block format. The runs happen in a subprocess (tests/gguf_engine_cases.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from inferline.kernels.cpu import gemm
from tests.gguf_checkpoints import CODED, write_gguf
from tests.interpreted import ROOT

pytestmark = pytest.mark.skipif(
    not gemm.available(), reason="the exact-levels search is in the C kernels"
)
NEW = 4
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def run_gguf_cases(path, cases: dict) -> dict[str, dict]:
    import os
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gguf_engine_cases.py"), str(path)],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1500,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return {line["variant"]: line for line in lines}


def hf_greedy_rows(hf, ids: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """transformers' greedy tokens (no stop at EOS) and the logits row each was chosen from."""
    rows, tokens = [], []
    with torch.inference_mode():
        for _ in range(n):
            row = hf(torch.tensor([ids + tokens])).logits[0, -1]
            rows.append(row)
            tokens.append(int(row.argmax()))
    return torch.stack(rows), tokens


def matched_error(engine_rows: torch.Tensor, hf_rows: torch.Tensor) -> float:
    """The worst relative error pairing each engine row with its nearest reference row, each
    reference row used once (the engine's rows come in step order, the requests interleaved)."""
    distance = torch.cdist(engine_rows, hf_rows)
    nearest = distance.argmin(dim=1)
    assert sorted(nearest.tolist()) == list(range(len(hf_rows))), "rows unmatched"
    return max(float(distance[i, j] / hf_rows[j].norm()) for i, j in enumerate(nearest.tolist()))


WIDER = dict(hidden=256, intermediate=768, heads=4, kv_heads=2)  # head_dim 64, as SmolLM2's


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, tied, shape",
    [
        pytest.param("llama", False, {}, id="llama"),
        pytest.param("qwen2", True, {}, marks=pytest.mark.full, id="qwen2-tied"),
        pytest.param("llama", True, WIDER, marks=pytest.mark.full, id="llama-wide-tied"),
    ],
)
def test_gguf_levels_on_the_w8a16_kernel_equal_the_dequantized_file_and_hf(
    arch, tied, shape, tmp_path, request
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inferline.worker.engine.models.loader import resolve_model_dir

    path = write_gguf(tmp_path / "tiny.gguf", arch, tied=tied, **shape)
    converted = resolve_model_dir(path)  # the engine's one-time conversion, removed after
    try:
        hf = AutoModelForCausalLM.from_pretrained(
            str(tmp_path), gguf_file=path.name, dtype=torch.float32
        ).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
        a = tokenizer("The quick brown fox jumps over the lazy dog again and again")["input_ids"]
        b = tokenizer("Hello there, friend")["input_ids"]
        cases = {
            "arrivals": [["a", a, NEW], ["b", b, NEW]],
            "scheduler": {"max_num_batched_tokens": 16},  # a's prompt in two chunks
            # make test: the codes against transformers alone (the suite's time budget)
            "variants": ["codes", "off"] if request.config.getoption("--full") else ["codes"],
        }
        runs = run_gguf_cases(path, cases)
    finally:
        shutil.rmtree(converted, ignore_errors=True)
    codes, off = runs["codes"], runs.get("off")
    # the loader's decisions: the legacy 32-value formats as codes, Q6_K and F16 dequantized,
    # never the embeddings or the LM head
    for i, coded in enumerate(CODED):
        for name in LINEARS:
            want = "uint8" if name.split(".")[1] in coded else "float32"
            assert codes["weights"][f"layers.{i}.{name}"] == want, (i, name, codes["weights"])
    assert codes["weights"]["embed_tokens"] == "float32"
    assert codes["weights"].get("lm_head", "float32") == "float32"
    assert codes["backends"]["attention"] == "triton", codes["backends"]
    rows = torch.tensor(codes["logits"])
    assert rows.shape == (2 * NEW, hf.config.vocab_size)
    if off is not None:  # the codes give the dequantized weights' logits and tokens
        assert set(off["weights"].values()) == {"float32"}, off["weights"]
        ref_rows = torch.tensor(off["logits"])
        assert float((rows - ref_rows).norm() / ref_rows.norm()) < 1e-5
        assert codes["tokens"] == off["tokens"]
    # and transformers' on the GGUF
    hf_a, tokens_a = hf_greedy_rows(hf, a, NEW)
    hf_b, tokens_b = hf_greedy_rows(hf, b, NEW)
    assert codes["tokens"] == {"a": tokens_a, "b": tokens_b}
    assert matched_error(rows, torch.cat([hf_a, hf_b])) < 1e-4
    assert len(set(tokens_a + tokens_b)) > 3, "degenerate outputs prove little"
