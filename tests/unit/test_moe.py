"""Mixture-of-experts (worker/engine/models/moe.py, kernels/moe.py): each family's routing, the
block padding of tokens sorted by expert, and tiny random Mixtral, Qwen3-MoE and Qwen2-MoE models
(2 layers, 4 experts, top-2, hidden 64; built from transformers configs, nothing downloaded)
giving transformers' greedy tokens through the engine on the CPU."""

from __future__ import annotations

import pytest
import torch

from inferline.config.settings import Settings
from inferline.kernels import moe
from inferline.kernels.backends import onednn_available
from inferline.kernels.cpu import gemm
from inferline.worker.engine.model_runner import ModelRunner
from inferline.worker.engine.models.loader import SUPPORTED, load_config, synthetic_tokenizer
from inferline.worker.engine.models.moe import SparseMoeBlock, moe_spec
from tests.engine_fixtures import greedy, make_engine, run_to_completion
from inferline.worker.engine.request import EngineRequest

SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    initializer_range=0.2,  # decisive logits: greedy ties stay out of the comparison
    tie_word_embeddings=False,
)
FAMILIES = {
    "mixtral": dict(num_local_experts=4, intermediate_size=96),
    # Qwen3-MoE as published: renormalized top-k; layer 1 dense (mlp_only_layers)
    "qwen3_moe": dict(
        num_experts=4,
        moe_intermediate_size=32,
        intermediate_size=96,
        head_dim=16,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),  # fmt: skip
    # Qwen2-MoE: raw top-k probabilities, the shared expert behind its sigmoid gate
    "qwen2_moe": dict(
        num_experts=4,
        moe_intermediate_size=32,
        intermediate_size=96,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
    ),  # fmt: skip
}
NEW_TOKENS = 12


def hf_model(family: str, **extra):
    """A random transformers model of `family` (SHAPE, FAMILIES[family], then `extra`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **{**SHAPE, **FAMILIES[family], **extra})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, the HF model, its folder) for each MoE family."""
    hf = hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    synthetic_tokenizer(hf.config).save_pretrained(folder)
    return request.param, hf, folder


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 17, 33, 9)]


def hf_greedy(hf, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        x = torch.tensor([ids])
        y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                        min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)  # fmt: skip
    return y[0, len(ids) :].tolist()


LINEAR_AVAILABLE = {"c": gemm.available, "onednn": onednn_available, "torch": lambda: True}


@pytest.mark.parametrize("cpu_linear", list(LINEAR_AVAILABLE))
def test_moe_engine_greedy_equals_hf_generate(family, cpu_linear):
    """Four prompts batched together through chunked prefill and decode: each gets HF's greedy
    tokens, with the experts on the C GEMM's and oneDNN's packed weights, and on F.linear."""
    if not LINEAR_AVAILABLE[cpu_linear]():
        pytest.skip(f"{cpu_linear} is not available here")
    name, hf, folder = family
    settings = Settings()
    m = settings.model
    m.path, m.device, m.dtype, m.max_model_len = str(folder), "cpu", "float32", 256
    m.cpu_linear = cpu_linear
    settings.cache.kv_memory_gb = 0.05
    runner = ModelRunner(settings)
    assert runner.backends.linear == cpu_linear
    blocks = [layer.mlp for layer in runner.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert len(blocks) == (1 if name == "qwen3_moe" else 2), name
    packed = cpu_linear != "torch"  # the experts run on the packed GEMM
    assert all((b.packed13 is not None and b.packed2 is not None) == packed for b in blocks)
    engine = make_engine(runner, max_num_batched_tokens=24, max_num_seqs=4)
    arrivals = {0: [EngineRequest(request_id=f"r{i}", prompt_token_ids=ids,
                                  sampling=greedy(NEW_TOKENS, ignore_eos=True))
                    for i, ids in enumerate(prompts())]}  # fmt: skip
    results = run_to_completion(engine, arrivals)
    for i, ids in enumerate(prompts()):
        assert results[f"r{i}"]["tokens"] == hf_greedy(hf, ids), (name, i)


def test_moe_families_are_supported_and_others_refused(tmp_path):
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"} <= set(SUPPORTED)
    from transformers import AutoConfig

    AutoConfig.for_model("olmoe", hidden_size=64, num_hidden_layers=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"'olmoe' is not supported \(supported: .*mixtral"):
        load_config(tmp_path)


# ---- routing ---------------------------------------------------------------------------------


def test_mixtral_routing_is_softmax_over_the_top_k_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.0, 0.0, 5.0, 4.0]])
    weights, ids = moe.select_experts(logits, 2, moe.TOPK_SOFTMAX)
    assert ids.tolist() == [[1, 2], [2, 3]]
    e = torch.tensor(1.0).exp()
    want = torch.tensor([[e / (e + 1), 1 / (e + 1)]] * 2)
    torch.testing.assert_close(weights, want)


@pytest.mark.parametrize("renormalize", [False, True])
def test_qwen_routing_is_top_k_of_the_softmax(renormalize):
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    weights, ids = moe.select_experts(logits, 2, moe.SOFTMAX_TOPK, renormalize)
    probs = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[1, 2]]
    want = probs[[1, 2]] / (probs[[1, 2]].sum() if renormalize else 1.0)
    torch.testing.assert_close(weights[0], want)
    assert (abs(float(weights.sum()) - 1.0) < 1e-6) == renormalize


@pytest.mark.parametrize("family", list(FAMILIES))
def test_routing_equals_transformers_router(family):
    """Each family's scoring against its transformers router on the same logits' weight."""
    hf = hf_model(family)
    router = hf.model.layers[0].mlp.gate
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(2))
    spec = moe_spec(hf.config)
    with torch.no_grad():
        _, want_w, want_ids = router(x)
        weights, ids = moe.select_experts(x @ router.weight.T, spec.top_k, spec.scoring,
                                          spec.renormalize)  # fmt: skip
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w.float())


def test_align_block_size_sorts_by_expert_and_pads_each_run():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # slots 0..5 in order; expert 1 gets none
    sorted_ids, expert_ids, num_padded = moe.align_block_size(ids, 4, block_m=4)
    assert int(num_padded) == 12  # expert 0: 2 -> 4, expert 2: 3 -> 4, expert 3: 1 -> 4
    pad = 6
    assert sorted_ids[:12].tolist() == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]
    assert expert_ids[:3].tolist() == [0, 2, 3]
    assert sorted_ids.numel() % 4 == 0 and expert_ids.numel() == sorted_ids.numel() // 4
    assert (sorted_ids[12:] == pad).all()


def test_grouped_experts_equal_the_reference():
    """The CPU path (tokens grouped by expert on the project's linear) against the dense fp32
    reference, with an expert that gets no token."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen3_moe", **SHAPE, **FAMILIES["qwen3_moe"])
    block = SparseMoeBlock(config, moe_spec(config))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        x = torch.randn(9, 64, generator=gen)
        weights, ids = moe.select_experts(block.gate(x), 2, moe.SOFTMAX_TOPK, True)
        ids[ids == 3] = 0  # expert 3 left without tokens
        got = block.grouped_experts(x, weights, ids, "torch")
        want = moe.fused_experts_torch(x, block.w13, block.w2, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
