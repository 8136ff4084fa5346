"""Gemma 2, Gemma 3 (text) and a Phi-4-mini-like Phi-3 against HF transformers: tiny random-weight
models built from transformers configs (nothing downloaded) give `generate`'s greedy tokens
through the engine on the CPU, on the C and the PyTorch attention.

Gemma 2: the sandwich norms of 1 + w, embeddings scaled by sqrt(hidden), GELU-tanh, the attention
logits soft-capped (a cap that bends them), query_pre_attn_scalar, windowed and full layers
alternating, tied embeddings. Gemma 3: its q/k norms, its local layers' own rope base, one full
layer in three. Phi-4-mini: phi3 with partial_rotary_factor 0.75, longrope and tied embeddings.
The norm weights are random (HF starts Gemma's at 0, where 1 + w is 1 and w alone is 0); the
prompts are longer than every window, and chunked prefill puts chunks on cached context."""

from __future__ import annotations

import pytest
import torch

from inferline.worker.engine.models import llama
from inferline.worker.engine.models.loader import SUPPORTED, load_config, synthetic_tokenizer
from inferline.worker.engine.request import EngineRequest
from tests.engine_fixtures import greedy, make_engine, run_to_completion
from tests.unit.test_window_rope import runner_for

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=3,
    vocab_size=256,
    rms_norm_eps=1e-6,
    initializer_range=0.25,  # logits far apart: greedy ties do not hang on rounding
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=None,  # no early stop: every run is NEW_TOKENS long
    pad_token_id=0,
)
NEW_TOKENS = 16
PROMPT_LENS = (41, 30, 13)  # past every window; the first in three 16-token chunks


def configs() -> dict:
    from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config

    return {
        # layers 0 and 2 windowed (7 tokens), 1 full; both soft-caps bend their inputs
        "gemma2": lambda: Gemma2Config(
            **SHAPE,
            sliding_window=7,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=4.0,
        ),
        # layers 0 and 2 local (window 7, rope base 10000), 1 global (base 1e6); q/k norms
        "gemma3_text": lambda: Gemma3TextConfig(
            **SHAPE,
            sliding_window=7,
            sliding_window_pattern=2,
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
        # Phi-4-mini's shape of rope: 12 of 16 dims rotate, longrope's short factors (within
        # original_max_position_embeddings), tied embeddings; a window of 20 on every layer
        "phi4-mini": lambda: Phi3Config(
            **{**SHAPE, "tie_word_embeddings": True},
            sliding_window=20,
            original_max_position_embeddings=128,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                partial_rotary_factor=0.75,
                short_factor=[1.0 + 0.1 * i for i in range(6)],
                long_factor=[2.0 + 0.5 * i for i in range(6)],
            ),
        ),
    }


def hf_model(name: str):
    """The random transformers model of `name`, its norm weights random too."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(configs()[name](), dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, param in hf.named_parameters():
            if param_name.endswith("norm.weight"):
                param.normal_(0.0, 0.5)
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


@pytest.fixture(scope="module", params=list(configs()))
def family(request, tmp_path_factory):
    """(name, model directory, HF model, HF greedy outputs)."""
    hf = hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    synthetic_tokenizer(hf.config).save_pretrained(folder)
    expected = [hf_greedy(hf, ids, NEW_TOKENS) for ids in prompts()]
    return request.param, folder, hf, expected


@pytest.mark.parametrize("attention", ["cpu", "torch"])
def test_engine_equals_hf_generate(family, attention):
    name, folder, _, expected = family
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
        assert results[f"r{i}"]["tokens"] == want, f"{name}: prompt {i} diverged from HF generate"


def test_engine_logits_equal_hf_forward(family):
    """Every step's logits (prefill in 16-token chunks, then decodes) against HF's forward over
    the prompt and the tokens generated: tokens alone would miss a change too small to turn a
    greedy choice (a wrong activation, scale or local rope base)."""
    name, folder, hf, _ = family
    runner = runner_for(folder, "cpu")
    rows, sample = [], runner.sampler.sample_on_device

    def capture(logits, *args, **kwargs):
        rows.extend(logits.float().clone())
        return sample(logits, *args, **kwargs)

    runner.sampler.sample_on_device = capture  # an instance attribute over the method
    ids = prompts()[0]
    engine = make_engine(runner, max_num_batched_tokens=16, enable_prefix_caching=False)
    request = EngineRequest(request_id="r", prompt_token_ids=ids, sampling=greedy(6))
    tokens = run_to_completion(engine, {0: [request]})["r"]["tokens"]
    with torch.inference_mode():
        want = hf(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :]
    got = torch.stack(rows)
    assert got.shape == want.shape, (got.shape, want.shape)
    err = float((got - want).abs().max())
    assert err < 1e-3, f"{name}: logits differ from HF by {err}"


@pytest.mark.parametrize("family", ["gemma2"], indirect=True)
def test_gemma2_final_logits_are_soft_capped(family):
    """Greedy tokens cannot see the final soft-cap (tanh keeps the order): the engine's logits of
    HF's final hidden states equal HF's logits, which the cap bends (uncapped, some pass 4)."""
    _, folder, hf, _ = family
    runner = runner_for(folder, "torch")
    x = torch.tensor([prompts()[2]])
    with torch.inference_mode():
        final = hf.model(x).last_hidden_state[0]
        logits = runner.model.compute_logits(final)
        want = hf(x).logits[0]
        assert float(hf.lm_head(final).abs().max()) > 4.0
    assert torch.allclose(logits, want, atol=1e-5)


def test_the_new_families_are_supported_and_others_refused(tmp_path):
    from transformers import AutoConfig

    for model_type in ("gemma2", "gemma3_text", "phi3"):
        assert model_type in SUPPORTED
    AutoConfig.for_model("gemma", **SHAPE).save_pretrained(tmp_path)  # Gemma 1: not (yet)
    with pytest.raises(ValueError, match="supported: .*gemma3_text"):
        load_config(tmp_path)


def test_partial_rotary_order_keeps_rotate_half_pairs():
    """rotary_order moves each rotated pair (i, i + rot/2) to (j, j + head_dim/2), kept dims
    after them: with tables of cos 1, sin 0 on the kept dims, rotating halves of the whole head
    equals HF's partial rotation of the original dims."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    head_dim, rot, pos = 16, 12, 37
    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    rotary = llama.RotaryEmbedding(head_dim, 64, params)
    order = llama.rotary_order(head_dim, rot)
    assert sorted(order.tolist()) == list(range(head_dim))
    x = torch.randn(1, 1, 1, head_dim)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rot, 2).float() / rot)
    freqs = torch.cat((pos * inv_freq, pos * inv_freq))
    want, _ = apply_rotary_pos_emb(x, x, freqs.cos()[None, None], freqs.sin()[None, None])
    from inferline.kernels.fused import rotate

    got = rotate(x[0, 0, :, order][None], rotary.cos[pos][None, None], rotary.sin[pos][None, None])
    assert torch.allclose(got[0, 0], want[0, 0, 0, order], atol=1e-6)
