"""gpt-oss against HF transformers: a tiny random-weight GptOssForCausalLM built from a transformers
config (nothing downloaded) gives `generate`'s greedy tokens through the engine on the CPU (fp32),
on the C and the PyTorch attention, and every step's logits equal HF's forward.

What it exercises: attention sinks (random, weighty beside the window's keys), q/k/v/o biases,
sliding and full layers alternating (`layer_types`, a window of 7 under prompts of 13-41 tokens),
yarn rope with truncate False (gpt-oss's own), the router's bias with top-k then softmax, the
experts stacked [E, in, out] with gate and up columns interleaved, their biases, and the clamped
SwiGLU (inputs large enough that the clamps bite). MXFP4 expert blocks are dequantized as
transformers' own function does (tests/unit/test_mxfp4.py)."""

from __future__ import annotations

import pytest
import torch

from inferline.kernels import moe
from inferline.worker.engine.models.loader import SUPPORTED, synthetic_tokenizer
from inferline.worker.engine.models.moe import SparseMoeBlock, moe_spec
from inferline.worker.engine.request import EngineRequest
from tests.engine_fixtures import greedy, make_engine, run_to_completion
from tests.unit.test_window_rope import runner_for

SHAPE = dict(
    hidden_size=64,
    intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=3,  # sliding, full, sliding (GptOssConfig's layer_types)
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=7,
    vocab_size=256,
    rms_norm_eps=1e-5,
    initializer_range=0.25,  # logits far apart: greedy ties do not hang on rounding
    max_position_embeddings=256,
    swiglu_limit=1.5,  # most gate and up values pass it: the clamps change the result
    bos_token_id=1,
    eos_token_id=None,  # no early stop: every run is NEW_TOKENS long
    pad_token_id=0,
)
NEW_TOKENS = 16
PROMPT_LENS = (41, 30, 13)  # past every window; the first in three 16-token chunks


def config(**extra):
    from transformers import GptOssConfig

    return GptOssConfig(**{**SHAPE, **extra})


def hf_model(**extra):
    """The random transformers model; its norms, biases and sinks random too (HF starts biases
    at 0 and norms at 1)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config(**extra), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.3)
            elif name.endswith("sinks"):
                param.normal_(1.0, 1.0)
            elif "bias" in name:
                param.normal_(0.0, 0.3)
    return hf


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [
        torch.randint(3, SHAPE["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENS
    ]


def hf_greedy(hf, ids: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        x = torch.tensor([ids])
        y = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return y[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(model directory, HF model, HF greedy outputs)."""
    hf = hf_model()
    folder = tmp_path_factory.mktemp("gpt_oss")
    hf.save_pretrained(folder)
    synthetic_tokenizer(hf.config).save_pretrained(folder)
    expected = [hf_greedy(hf, ids, NEW_TOKENS) for ids in prompts()]
    return folder, hf, expected


@pytest.mark.parametrize("attention", ["cpu", "torch"])
def test_engine_equals_hf_generate(gpt_oss, attention):
    folder, hf, expected = gpt_oss
    assert hf.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    runner = runner_for(folder, attention)
    assert runner.backends.attention == attention
    # a 16-token budget: the 41-token prompt in three chunks, beside the others' decodes
    engine = make_engine(runner, max_num_batched_tokens=16, enable_prefix_caching=False)
    requests = [
        EngineRequest(
            request_id=f"r{i}", prompt_token_ids=ids, sampling=greedy(NEW_TOKENS, ignore_eos=True)
        )
        for i, ids in enumerate(prompts())
    ]
    results = run_to_completion(engine, {0: requests})
    for i, want in enumerate(expected):
        assert results[f"r{i}"]["tokens"] == want, f"prompt {i} diverged from HF generate"


@pytest.mark.parametrize("attention", ["cpu", "torch"])
def test_engine_logits_equal_hf_forward(gpt_oss, attention):
    """Every step's logits (prefill in 16-token chunks, then decodes) against HF's forward over
    the prompt and the tokens generated: tokens alone would miss a change too small to turn a
    greedy choice."""
    folder, hf, _ = gpt_oss
    runner = runner_for(folder, attention)
    rows, sample = [], runner.sampler.sample_on_device

    def capture(logits, *args, **kwargs):
        rows.extend(logits.float().clone())
        return sample(logits, *args, **kwargs)

    runner.sampler.sample_on_device = capture  # an instance attribute over the method
    ids = prompts()[0]
    engine = make_engine(runner, max_num_batched_tokens=16, enable_prefix_caching=False)
    request = EngineRequest(request_id="r", prompt_token_ids=ids, sampling=greedy(8))
    tokens = run_to_completion(engine, {0: [request]})["r"]["tokens"]
    with torch.inference_mode():
        want = hf(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :]
    got = torch.stack(rows)
    assert got.shape == want.shape, (got.shape, want.shape)
    err = float((got - want).abs().max())
    assert err < 1e-3, f"logits differ from HF by {err}"


def test_experts_equal_transformers_experts():
    """One MoE block on HF's weights (read as the loader reads them, then reordered) against
    transformers' GptOssMLP, on the CPU path and the fused reference: the router's bias, top-k
    then softmax, the de-interleaved gate/up, both biases and the clamped SwiGLU."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = config()
    torch.manual_seed(4)
    hf = GptOssMLP(cfg)
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.3)
    block = SparseMoeBlock(cfg, moe_spec(cfg))
    params = {"layers.0.mlp." + n: p.detach() for n, p in block.named_parameters()}
    from inferline.worker.engine.models.moe import moe_destinations

    targets = moe_destinations(params, block, "model.layers.0.", "layers.0.")
    state = {"model.layers.0.mlp." + n: p.detach() for n, p in hf.named_parameters()}
    assert set(targets) == set(state)
    with torch.no_grad():
        for name, dst in targets.items():
            dst.copy_(state[name])
        block.from_stacked_checkpoint()
        x = torch.randn(11, 64, generator=torch.Generator().manual_seed(5)) * 2
        want = hf(x[None])[0][0]
        got = block(x)
        weights, ids = moe.select_experts(block.gate(x), 2, moe.TOPK_SOFTMAX)
        fused = moe.fused_experts_torch(x, block.w13, block.w2, weights, ids, block.b13,
                                        block.b2, block.spec.swiglu)  # fmt: skip
        h = x @ hf.experts.gate_up_proj[0] + hf.experts.gate_up_proj_bias[0]
    limit = cfg.swiglu_limit
    assert float((h[:, ::2] > limit).float().mean()) > 0.1, "the gate clamp never bites"
    assert float((h[:, 1::2].abs() > limit).float().mean()) > 0.1, "the up clamp never bites"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-5)


def test_gpt_oss_is_supported():
    assert "gpt_oss" in SUPPORTED
