"""Weights in: a local HF directory (safetensors), a GGUF file, or random (`load_format=dummy`).

A GGUF file is dequantized once through transformers (slow) and cached as a plain HF directory
(config, tokenizer, safetensors) under the cache folder, which every later start, test and
benchmark loads quickly.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import structlog
import torch
from transformers import AutoConfig, AutoTokenizer, LlamaConfig

from config.settings import bundled_model_path, cache_dir
from worker.engine.models.llama import LlamaForCausalLM

log = structlog.get_logger(__name__)

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")

# Shapes for speed work without weights (`load_format=dummy`, model path = one of these names).
DUMMY_PRESETS = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                         tie_word_embeddings=True),
}


def resolve_model_dir(path: str | os.PathLike | None = None) -> Path:
    """An HF directory for `path`: the directory itself, or the cached conversion of a GGUF."""
    path = Path(path) if path else bundled_model_path()
    if path.is_dir():
        return path
    if path.suffix != ".gguf":
        raise FileNotFoundError(f"model path {path} is neither a directory nor a .gguf file")
    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_dir() / "models" / f"{path.stem}-{key}"
    if not (target / "config.json").exists():
        convert_gguf(path, target)
    return target


def convert_gguf(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM

    log.info("converting GGUF once", gguf=str(gguf), target=str(target))
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    # save_pretrained refuses a model "quantized with gguf"; its tensors are plain fp32 by now.
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # shares memory with the embedding
    save_file(state, str(tmp / "model.safetensors"))
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, target)  # atomic: a concurrent converter either wins or finds it done
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def load_config(model_dir: Path):
    config = AutoConfig.from_pretrained(str(model_dir))
    if config.model_type not in SUPPORTED:
        raise ValueError(f"model type {config.model_type!r} is not supported (supported: {SUPPORTED})")
    return config


def load_tokenizer(model_dir: Path | None):
    return AutoTokenizer.from_pretrained(str(model_dir or resolve_model_dir(None)))


def load_model(path: str, load_format: str, dtype: torch.dtype, device: torch.device,
               max_positions: int):
    """Returns (model, config, tokenizer)."""
    if load_format == "dummy":
        return load_dummy(path, dtype, device, max_positions)
    model_dir = resolve_model_dir(path or None)
    config = load_config(model_dir)
    with torch.device(device):
        model = LlamaForCausalLM(config, max_positions).to(dtype)
    model.load_state_dict(fused_state_dict(read_safetensors(model_dir), config), strict=True)
    return model.eval(), config, load_tokenizer(model_dir)


def load_dummy(path: str, dtype, device, max_positions):
    """Random weights with the shapes of a preset, a config.json or an HF directory.
    Text prompts use the bundled SmolLM2 tokenizer (its ids fit any preset's vocabulary)."""
    if path in DUMMY_PRESETS:
        config = LlamaConfig(**DUMMY_PRESETS[path])
    else:
        config = load_config(resolve_model_dir(path or None))
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config, max_positions).to(dtype)
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.data.normal_(0.0, 0.02)
    return model.eval(), config, load_tokenizer(None)


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return weights


def fused_state_dict(hf: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """HF names -> this model's names, with q/k/v and gate/up concatenated."""
    out = {"embed_tokens.weight": hf["model.embed_tokens.weight"], "norm": hf["model.norm.weight"]}
    if not getattr(config, "tie_word_embeddings", False):
        out["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        out.update(fused_layer(hf, f"model.layers.{i}.", f"layers.{i}."))
    return out


def fused_layer(hf: dict, src: str, dst: str) -> dict[str, torch.Tensor]:
    attn, mlp = src + "self_attn.", src + "mlp."
    out = {
        dst + "self_attn.qkv_proj.weight": torch.cat([hf[f"{attn}{p}_proj.weight"] for p in "qkv"]),
        dst + "self_attn.o_proj.weight": hf[attn + "o_proj.weight"],
        dst + "mlp.gate_up_proj.weight": torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]]),
        dst + "mlp.down_proj.weight": hf[mlp + "down_proj.weight"],
        dst + "input_layernorm": hf[src + "input_layernorm.weight"],
        dst + "post_attention_layernorm": hf[src + "post_attention_layernorm.weight"],
    }
    if attn + "q_proj.bias" in hf:
        out[dst + "self_attn.qkv_proj.bias"] = torch.cat([hf[f"{attn}{p}_proj.bias"] for p in "qkv"])
    if attn + "q_norm.weight" in hf:
        out[dst + "self_attn.q_norm"] = hf[attn + "q_norm.weight"]
        out[dst + "self_attn.k_norm"] = hf[attn + "k_norm.weight"]
    return out
