"""FP8 checkpoints (worker/engine/models/quantization.py, the loader): a tiny random Llama and Qwen3
(transformers configs, nothing downloaded) with their decoder projections quantized to e4m3 here in
each published format (compressed-tensors per tensor and per channel, fp8 per 32 x 32 block and per
tensor) load on the CPU as the dequantized weights, exactly, and give transformers' logits and
greedy tokens on those weights through the engine; unsupported schemes and malformed scales are
refused at load, naming the scheme. The Triton W8A16 path: tests/kernels/test_fp8_triton.py. And a
GGUF's exact uint8 levels kept as codes (the shallow SmolLM2)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from inferline.config.settings import Settings
from inferline.kernels.cpu import gemm
from inferline.kernels.fp8 import dequantize
from inferline.worker.engine.model_runner import ModelRunner
from inferline.worker.engine.models.linear import Linear
from inferline.worker.engine.models.loader import load_config, load_weights
from inferline.worker.engine.models.quantization import UnsupportedQuantization
from inferline.worker.engine.request import EngineRequest
from tests.engine_fixtures import greedy, make_engine, run_to_completion
from tests.fp8_checkpoints import FORMATS, hf_model, prompts, write_checkpoint
from tests.kernels.test_triton_engine import hf_greedy

NEW = 8
# make test loads one (family, format); make test-full every pair
CASES = [
    pytest.param(f, fmt, marks=() if (f, fmt) == ("llama", "ct-channel") else pytest.mark.full)
    for f in ("llama", "qwen3")
    for fmt in FORMATS
] + [pytest.param("qwen3_moe", fmt, marks=pytest.mark.full) for fmt in ("ct-channel", "fp8-block")]


def cpu_runner(folder) -> ModelRunner:
    settings = Settings()
    m = settings.model
    m.path, m.device, m.dtype, m.max_model_len = str(folder), "cpu", "float32", 256
    m.cpu_linear_calibrate = False
    settings.cache.kv_memory_gb = 0.05
    return ModelRunner(settings)


def engine_logits(runner, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Every sampled row's logits and the tokens of one greedy request through the engine."""
    rows, sample = [], runner.sampler.sample_on_device

    def capture(logits, *args, **kwargs):
        rows.extend(logits.float().clone())
        return sample(logits, *args, **kwargs)

    runner.sampler.sample_on_device = capture  # an instance attribute over the method
    try:
        req = EngineRequest(request_id="r", prompt_token_ids=ids, sampling=greedy(NEW))
        tokens = run_to_completion(make_engine(runner), {0: [req]})["r"]["tokens"]
    finally:
        del runner.sampler.sample_on_device
    return torch.stack(rows), tokens


@pytest.mark.parametrize("family, fmt", CASES)
def test_fp8_checkpoint_on_cpu_equals_the_dequantized_model(family, fmt, tmp_path):
    hf = hf_model(family)
    errors = write_checkpoint(hf, fmt, tmp_path)  # hf now holds the dequantized weights
    assert 0 < max(errors.values()) < 0.05, errors  # e4m3 rounding (3 mantissa bits), no more
    runner = cpu_runner(tmp_path)
    # dequantized once at load: plain fp32 weights, the reference's exactly (q, k, v fused)
    assert all(m.weight.dtype == torch.float32 for m in runner.model.modules()
               if isinstance(m, Linear))  # fmt: skip
    layer, ref = runner.model.layers[1], hf.model.layers[1]
    if family == "qwen3_moe":  # the experts' stacked weights
        assert torch.equal(layer.mlp.w13, ref.mlp.experts.gate_up_proj)
        assert torch.equal(layer.mlp.w2, ref.mlp.experts.down_proj)
    else:
        assert torch.equal(layer.mlp.down_proj.weight, ref.mlp.down_proj.weight)
    layer, ref = layer.self_attn, ref.self_attn
    want = torch.cat([getattr(ref, f"{p}_proj").weight for p in "qkv"])
    assert torch.equal(layer.qkv_proj.weight, want)
    ids = prompts()[1]
    rows, tokens = engine_logits(runner, ids)
    with torch.inference_mode():
        full = torch.tensor([ids + tokens[:-1]])
        hf_rows = hf(full).logits[0, len(ids) - 1 :]
    assert rows.shape == hf_rows.shape
    assert float((rows - hf_rows).norm() / hf_rows.norm()) < 1e-4
    engine = make_engine(runner, max_num_batched_tokens=24, max_num_seqs=4)
    arrivals = {0: [EngineRequest(request_id=f"r{i}", prompt_token_ids=p,
                                  sampling=greedy(NEW))
                    for i, p in enumerate(prompts())]}  # fmt: skip
    results = run_to_completion(engine, arrivals)
    for i, p in enumerate(prompts()):
        assert results[f"r{i}"]["tokens"] == hf_greedy(hf, p, NEW), (family, fmt, i)


def write_config(folder, quantization: dict) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256)  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    body = {**config.to_dict(), "quantization_config": quantization}
    (folder / "config.json").write_text(json.dumps(body))


def ct(weights: dict | None, acts: dict | None = None, fmt: str = "float-quantized") -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"g": group}}


FP8_ACTS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
INT4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}
REFUSED = {
    "activations only": (ct(None, FP8_ACTS), r"activations only \(float8 \(token\)\)"),
    "int4 packed": (ct(INT4, fmt="pack-quantized"), "format 'pack-quantized'"),
    "int4 weights": (ct(INT4), r"weights int4 \(group\)"),
    "int8 weights": (ct({**INT4, "num_bits": 8, "strategy": "channel"}), "weights int8"),
    "fp8 group strategy": (ct({**FP8_ACTS, "strategy": "group"}), "strategy 'group'"),
    "gptq": ({"quant_method": "gptq", "bits": 4}, "quantization 'gptq' is not supported"),
    "e5m2": ({"quant_method": "fp8", "fmt": "e5m2"}, "fp8 fmt 'e5m2'"),
    "bad block": ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_schemes_are_refused_at_load_naming_them(case, tmp_path):
    quantization, message = REFUSED[case]
    write_config(tmp_path, quantization)
    with pytest.raises(UnsupportedQuantization, match=message):
        load_config(tmp_path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A compressed-tensors per-channel Llama: (folder, its tensors, its config)."""
    folder = tmp_path_factory.mktemp("ct-channel")
    write_checkpoint(hf_model("llama"), "ct-channel", folder)
    config = json.loads((folder / "config.json").read_text())
    return folder, load_file(str(folder / "model.safetensors")), config


SCALE = "model.layers.0.mlp.down_proj.weight_scale"
EMBED = "model.embed_tokens.weight"
BROKEN = {
    "a scale missing": (lambda t: t.pop(SCALE), "lacks its scale " + SCALE),
    "a scale too short": (lambda t: t.update({SCALE: t[SCALE][:-1]}), "does not fit"),
    "a negative scale": (lambda t: t[SCALE].neg_(), "negative, inf or NaN"),
    "a NaN scale": (lambda t: t[SCALE].fill_(float("nan")), "negative, inf or NaN"),
    "fp8 embeddings": (lambda t: t.update({EMBED: t[EMBED].to(torch.float8_e5m2)}), "float8_e5m2"),
}


@pytest.mark.parametrize("case", [*BROKEN, "no quantization_config"])
def test_malformed_fp8_checkpoints_are_refused_naming_the_scheme(case, checkpoint, tmp_path):
    folder, tensors, config = checkpoint
    tensors = {k: v.clone() for k, v in tensors.items()}
    if case == "no quantization_config":
        config = {k: v for k, v in config.items() if k != "quantization_config"}
        message = "no quantization_config"
    else:
        mutate, message = BROKEN[case]
        mutate(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantization, match=message) as err:
        load_weights(tmp_path, load_config(tmp_path), torch.float32, torch.device("cpu"), 64)
    if case != "no quantization_config":  # the scheme named
        assert "compressed-tensors (float8 e4m3 weights, per-channel" in str(err.value), err.value


@pytest.mark.skipif(not gemm.available(), reason="the exact-levels search is in the C kernels")
def test_gguf_levels_stay_uint8_codes_where_the_kernel_runs(shallow_smollm2):
    """`gguf_levels` (on CUDA): the GGUF's Q4_1 linear weights load as uint8 levels with a scale
    and an offset per 32 inputs that give back every fp32 weight exactly, and the layers compute
    with them (here on the kernel's PyTorch reference; the kernel: tests/fp8_cases.py)."""
    config, cpu = load_config(shallow_smollm2), torch.device("cpu")
    plain = load_weights(shallow_smollm2, config, torch.float32, cpu, 64)
    coded = load_weights(shallow_smollm2, config, torch.float32, cpu, 64, gguf_levels=True)
    pairs = [(a, b) for a, b in zip(coded.modules(), plain.modules()) if isinstance(a, Linear)]
    assert len(pairs) == 4 * config.num_hidden_layers  # qkv, o, gate_up, down
    for a, b in pairs:
        assert a.weight.dtype == torch.uint8 and a.group_k == 32
        assert torch.equal(dequantize(a.weight, a.weight_scale, 32, a.weight_offset), b.weight)
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    qkv, ref = pairs[0]
    assert torch.allclose(qkv(x), ref(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(coded.embed_tokens.weight, plain.embed_tokens.weight)  # not a linear layer


def test_gpu_weight_codes_off_dequantizes_on_cuda_too():
    """`INFERLINE_MODEL__GPU_WEIGHT_CODES=off`: a way back to dequantized weights on a GPU."""
    from types import SimpleNamespace

    cuda = SimpleNamespace(device=torch.device("cuda"))
    assert ModelRunner._weight_codes(cuda, Settings())
    assert not ModelRunner._weight_codes(cuda, Settings(model={"gpu_weight_codes": "off"}))
    # a GGUF's levels: codes by default on CUDA (tests/kernels/test_gguf_triton.py runs them),
    # dequantized with `off` and on the CPU
    assert ModelRunner._gguf_levels(cuda, Settings())
    assert not ModelRunner._gguf_levels(cuda, Settings(model={"gpu_weight_codes": "off"}))
    cpu = SimpleNamespace(device=torch.device("cpu"))
    assert not ModelRunner._gguf_levels(cpu, Settings())


@pytest.mark.parametrize("fmt", ["ct-channel", "fp8-block"])
def test_fp8_moe_experts_stay_codes_where_the_kernel_runs(fmt, tmp_path):
    """`weight_codes` (CUDA, or the interpreter with Triton attention): a Qwen3-MoE's FP8 experts
    load as e4m3 codes with fp32 scales [E, N, groups], each expert's rows beside its own scales:
    dequantized they are the CPU load's weights exactly, and the block computes the same (here
    on the grouped PyTorch path; the fused kernel's W8A16 variant: tests/moe_cases.py)."""
    from inferline.kernels.fp8 import FP8
    from inferline.worker.engine.models.moe import SparseMoeBlock

    write_checkpoint(hf_model("qwen3_moe"), fmt, tmp_path)
    config, cpu = load_config(tmp_path), torch.device("cpu")
    plain = load_weights(tmp_path, config, torch.float32, cpu, 64)
    coded = load_weights(tmp_path, config, torch.float32, cpu, 64, weight_codes=True)
    pairs = [(a, b) for a, b in zip(coded.modules(), plain.modules())
             if isinstance(a, SparseMoeBlock)]  # fmt: skip
    assert len(pairs) == config.num_hidden_layers
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    for a, b in pairs:
        assert a.coded() and a.w13.dtype == a.w2.dtype == FP8
        assert a.group_k == (32 if fmt == "fp8-block" else 0)
        for e in range(a.spec.num_experts):
            w13, w2 = a.expert_weights(e)
            assert torch.equal(w13, b.w13[e]) and torch.equal(w2, b.w2[e]), e
        assert torch.allclose(a(x), b(x), rtol=1e-5, atol=1e-6)
