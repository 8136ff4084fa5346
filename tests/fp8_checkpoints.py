"""Tiny FP8 checkpoints for the tests: a random transformers Llama or Qwen3 (nothing downloaded),
its decoder linear weights quantized to e4m3 here in one of the published formats, saved as
safetensors with its config; and the same model with the dequantized weights (the reference)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,  # down_proj's K: three 32-column scale groups
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=512,
    initializer_range=0.2,  # decisive logits: greedy ties stay out of the comparison
    tie_word_embeddings=False,
    eos_token_id=None,  # no early stop: every request runs its whole length
)
# Qwen3-MoE: 4 experts, top-2; its experts' projections are FP8 too (dequantized at load)
EXTRA = {"qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, num_experts_per_tok=2,
                           norm_topk_prob=True)}  # fmt: skip
BLOCK = (32, 32)  # the tests' fp8 block format: several blocks per weight at these sizes
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# format name -> (quantization_config, how scales are cut, the scale's suffix, static input scale)
FORMATS = {
    "ct-tensor": "compressed-tensors, one scale per tensor, static input scales",
    "ct-channel": "compressed-tensors, one scale per output channel, dynamic activations",
    "fp8-block": "fp8 (Qwen3-FP8, DeepSeek): weight_scale_inv per 32 x 32 block",
    "fp8-tensor": "fp8 without weight_block_size: one weight_scale per tensor",
}


def ct_config(strategy: str, static: bool) -> dict:
    acts = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": not static,
        "strategy": "tensor" if static else "token",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "dynamic": False,
                    "strategy": strategy,
                },
                "input_activations": acts,
            }
        },
    }


def quantization_config(fmt: str) -> dict:
    return {
        "ct-tensor": lambda: ct_config("tensor", True),
        "ct-channel": lambda: ct_config("channel", False),
        "fp8-block": lambda: {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(BLOCK),
        },
        "fp8-tensor": lambda: {"quant_method": "fp8", "activation_scheme": "static"},
    }[fmt]()


def quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, the scale as the format stores it) of the fp32 weight w [N, K]."""
    n, k = w.shape
    if fmt == "fp8-block":
        bn, bk = BLOCK
        padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
        padded[:n, :k] = w.abs()
        amax = padded.view(padded.shape[0] // bn, bn, -1, bk).amax(dim=(1, 3))
        scale = amax.clamp_min(1e-12) / FP8_MAX
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    elif fmt == "ct-channel":
        scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX  # [N, 1]
        full = scale
    else:
        scale = (w.abs().amax().clamp_min(1e-12) / FP8_MAX).reshape(1 if fmt == "ct-tensor" else ())
        full = scale
    return (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantized(codes: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    n, k = codes.shape
    if fmt == "fp8-block":
        bn, bk = BLOCK
        scale = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    return codes.float() * scale


def hf_model(family: str = "llama", **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **{**SHAPE, **EXTRA.get(family, {}), **extra})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def write_checkpoint(hf, fmt: str, folder: Path, drop: str | None = None) -> dict:
    """Save `hf` to `folder` with its decoder projections in FP8 `fmt`, its tokenizer beside;
    load the dequantized weights into `hf` (the reference). `drop`: leave out every tensor whose
    name ends so (a broken checkpoint). Returns {name: relative error of the dequantized weight}."""
    from safetensors.torch import save_file

    from inferline.worker.engine.models.loader import synthetic_tokenizer

    state = per_expert({k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()})
    out, errors, suffix = {}, {}, "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
    for name, w in list(state.items()):
        if not any(name.endswith(f"{p}.weight") for p in PROJECTIONS):
            out[name] = w
            continue
        codes, scale = quantize(w, fmt)
        out[name], out[name.removesuffix("weight") + suffix] = codes, scale
        if fmt in ("ct-tensor", "fp8-tensor"):  # static activation scales, which nothing reads
            out[name.removesuffix("weight") + "input_scale"] = torch.ones(scale.shape)
        deq = dequantized(codes, scale, fmt)
        errors[name] = float((deq - w).norm() / w.norm())
        state[name] = deq
    hf.load_state_dict(stacked(state))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v for k, v in out.items() if not (drop and k.endswith(drop))},
        str(folder / "model.safetensors"),
    )
    config = {**hf.config.to_dict(), "quantization_config": quantization_config(fmt)}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    synthetic_tokenizer(hf.config).save_pretrained(folder)
    return errors


def per_expert(state: dict) -> dict:
    """transformers 5 holds a layer's experts stacked (`experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I]); checkpoints hold one tensor per expert and projection."""
    out = {}
    for name, w in state.items():
        if name.endswith("experts.gate_up_proj"):
            inter = w.shape[1] // 2
            for e in range(w.shape[0]):
                out[f"{name.removesuffix('gate_up_proj')}{e}.gate_proj.weight"] = w[
                    e, :inter
                ].contiguous()
                out[f"{name.removesuffix('gate_up_proj')}{e}.up_proj.weight"] = w[
                    e, inter:
                ].contiguous()
        elif name.endswith("experts.down_proj"):
            for e in range(w.shape[0]):
                out[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"] = w[e].contiguous()
        else:
            out[name] = w
    return out


def stacked(state: dict) -> dict:
    """per_expert's inverse, for loading the dequantized weights into transformers' model."""
    out, experts = {}, {}
    for name, w in state.items():
        head, sep, tail = name.partition("experts.")
        if not sep:
            out[name] = w
            continue
        e, proj = tail.split(".")[:2]
        experts.setdefault(head + sep, {}).setdefault(int(e), {})[proj] = w
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        out[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]]) for e in ids]
        )
        out[prefix + "down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in ids])
    return out


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 17, 33)]
