"""Sliding-window attention and the long-context rope kinds against HF transformers: tiny
random-weight models built from transformers configs (nothing downloaded) give `generate`'s
greedy tokens through the engine on the CPU, on the C and the PyTorch attention.

The prompts are longer than every window, chunked prefill puts chunks on cached context, and
the dynamic rope kinds generate past the length where their scaling changes."""

from __future__ import annotations

import json

import pytest
import torch

from inferline.config.settings import Settings
from inferline.worker.engine.model_runner import ModelRunner
from inferline.worker.engine.models import llama
from inferline.worker.engine.models.loader import synthetic_tokenizer
from inferline.worker.engine.request import EngineRequest
from tests.engine_fixtures import greedy, make_engine, run_to_completion

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=3,
    vocab_size=256,
    rms_norm_eps=1e-5,
    initializer_range=0.25,  # logits far apart: greedy ties do not hang on rounding
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=None,  # no early stop: every run is NEW_TOKENS long
)
NEW_TOKENS = 24


def configs() -> dict:
    from transformers import LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    short, long = [1.0 + 0.1 * i for i in range(8)], [2.0 + 0.5 * i for i in range(8)]
    return {
        # every layer windowed: 20 tokens, past a 16-token block
        "mistral-window": lambda: MistralConfig(
            **SHAPE, sliding_window=20, max_position_embeddings=256
        ),
        # layers 1 and 2 windowed (7 tokens), layer 0 full
        "qwen2-mixed-window": lambda: Qwen2Config(
            **SHAPE,
            use_sliding_window=True,
            sliding_window=7,
            max_window_layers=1,
            max_position_embeddings=256,
        ),
        # Qwen3's q/k norms; layers 1 and 2 windowed (9 tokens)
        "qwen3-mixed-window": lambda: Qwen3Config(
            **SHAPE,
            use_sliding_window=True,
            sliding_window=9,
            max_window_layers=1,
            max_position_embeddings=256,
        ),
        "llama-yarn": lambda: LlamaConfig(
            **SHAPE,
            max_position_embeddings=256,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=8.0,
                original_max_position_embeddings=32,
            ),
        ),  # fmt: skip
        # generation crosses max_position_embeddings (48): the base grows at every step past it
        "llama-dynamic": lambda: LlamaConfig(
            **SHAPE,
            max_position_embeddings=48,
            rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0),
        ),
        # generation crosses original_max_position_embeddings (48): short factors, then long
        "llama-longrope": lambda: LlamaConfig(
            **SHAPE,
            max_position_embeddings=256,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                short_factor=short,
                long_factor=long,
                original_max_position_embeddings=48,
            ),
        ),  # fmt: skip
        # fused qkv_proj / gate_up_proj checkpoints, a window on every layer, longrope's short
        # factors and attention factor (within original_max_position_embeddings: transformers'
        # Phi-3 recomputes its whole cache with the long factors when a sequence crosses it)
        "phi3-window-longrope": lambda: Phi3Config(
            **SHAPE,
            pad_token_id=0,
            sliding_window=20,
            max_position_embeddings=256,
            original_max_position_embeddings=128,
            rope_parameters=dict(
                rope_type="longrope", rope_theta=10000.0, short_factor=short, long_factor=long
            ),
        ),
    }


# Prompt lengths: past every window, and for the dynamic kinds within their threshold (48), which
# the generated tokens then cross (transformers scales a whole prompt by its longest position).
PROMPT_LENS = (41, 30, 13)


@pytest.fixture(scope="module", params=list(configs()))
def family(request, tmp_path_factory):
    """(name, model directory, HF model, prompts, HF greedy outputs)."""
    config = configs()[request.param]()
    folder = tmp_path_factory.mktemp(request.param)
    hf, prompts, expected = saved_with_greedy(config, folder, 1, PROMPT_LENS, NEW_TOKENS)
    return request.param, folder, hf, prompts, expected


def saved_with_greedy(config, folder, seed: int, prompt_lens, new_tokens: int):
    """A random-weight HF model of `config` saved to `folder` with a synthetic tokenizer; random
    prompts of `prompt_lens` (generator `seed`) and HF's greedy `new_tokens` for each:
    (HF model, prompts, outputs)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(folder)
    synthetic_tokenizer(config).save_pretrained(folder)
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, SHAPE["vocab_size"], (n,), generator=gen).tolist() for n in prompt_lens
    ]
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            expected.append(y[0, len(ids) :].tolist())
    return hf, prompts, expected


def runner_for(folder, attention: str) -> ModelRunner:
    settings = Settings()
    settings.model.path = str(folder)
    settings.model.max_model_len = 128
    settings.model.attention_backend = attention
    settings.cache.kv_memory_gb = 0.01
    return ModelRunner(settings)


@pytest.mark.parametrize("attention", ["cpu", "torch"])
def test_engine_equals_hf_generate(family, attention):
    name, folder, _, prompts, expected = family
    runner = runner_for(folder, attention)
    assert runner.backends.attention == attention
    # a 16-token budget: the 41-token prompt in three chunks, beside the others' decodes
    engine = make_engine(runner, max_num_batched_tokens=16, enable_prefix_caching=False)
    requests = [
        EngineRequest(
            request_id=f"r{i}",
            prompt_token_ids=ids,
            sampling=greedy(NEW_TOKENS, ignore_eos=True),
        )
        for i, ids in enumerate(prompts)
    ]
    results = run_to_completion(engine, {0: requests})
    for i, want in enumerate(expected):
        assert results[f"r{i}"]["tokens"] == want, f"{name}: prompt {i} diverged from HF generate"


def test_layer_windows_follow_the_config():
    from transformers import MistralConfig, Qwen2Config

    assert llama.layer_windows(MistralConfig(**SHAPE, sliding_window=20)) == [20, 20, 20]
    assert llama.layer_windows(MistralConfig(**SHAPE, sliding_window=None)) == [None] * 3
    mixed = Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=7, max_window_layers=1)
    assert llama.layer_windows(mixed) == [None, 7, 7]
    off = Qwen2Config(**SHAPE, use_sliding_window=False, sliding_window=7)
    assert llama.layer_windows(off) == [None] * 3


@pytest.mark.parametrize("name", ["llama-yarn", "llama-dynamic", "llama-longrope"])
def test_rope_tables_equal_transformers_cos_sin(name):
    """Each position's (cos, sin) against transformers' rotary embedding run for a sequence
    that ends at that position (how `generate` meets it in a decode step)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = configs()[name]()
    rotary = llama.RotaryEmbedding(16, 96, llama.rope_parameters(config), config)
    hf = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, 1, 16)
    for pos in (0, 5, 31, 47, 48, 49, 70, 95):
        cos, sin = hf(x, torch.tensor([[pos]]))
        assert torch.allclose(rotary.cos[pos], cos[0, 0], atol=1e-5), (name, pos)
        half = 8
        assert torch.allclose(rotary.sin[pos, half:], sin[0, 0, half:], atol=1e-5), (name, pos)


TRITON_TOKENS = 10


@pytest.mark.full  # ~14 s each on the interpreter: make test-full (the suite's time budget)
@pytest.mark.parametrize("family", [n for n in configs() if "window" in n], indirect=True)
def test_triton_kernels_equal_hf_generate(family):
    """The same engine runs on the Triton kernels under the interpreter (prefill chunks on
    cached context, decode with the window's first block past block 0); the windowed families
    only: the rope kinds change the tables, not the kernels."""
    name, folder, _, prompts, expected = family
    cases = {
        "model": str(folder),
        "runs": [
            {
                "name": "chunked",
                "scheduler": {"max_num_batched_tokens": 16, "enable_prefix_caching": False},
                "arrivals": {"0": [[f"r{i}", ids, TRITON_TOKENS] for i, ids in enumerate(prompts)]},
            }
        ],
    }
    lines = run_cases_stdin(cases)
    tokens = next(line["tokens"] for line in lines if line.get("run") == "chunked")
    for i, want in enumerate(expected):
        assert tokens[f"r{i}"] == want[:TRITON_TOKENS], f"{name}: prompt {i} on Triton diverged"


def run_cases_stdin(cases: dict) -> list[dict]:
    from tests.kernels.test_triton_engine import run_cases as run_engine_cases

    return run_engine_cases(["smollm2"], json.dumps(cases))
