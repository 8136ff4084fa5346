"""What Gemma 2 and Gemma 3 (text) add to the Llama-family decoder: RMSNorm of 1 + w in fp32,
a norm after attention and around the MLP (the sandwich), embeddings scaled by sqrt(hidden),
the final logits soft-capped. design: docs/architecture.md#the-model
"""

from __future__ import annotations

import torch
from torch import nn

from inferline.kernels.attention import AttentionMetadata
from inferline.kernels.fused import gemma_rms_norm

FAMILIES = ("gemma2", "gemma3_text")
# A Gemma layer's norms, by their checkpoint names (each `weight` holds w; the model 1 + w).
LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


def is_gemma(config) -> bool:
    return config.model_type in FAMILIES


def embed_scale(config, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) in the model's dtype, as HF multiplies the embeddings by it."""
    return float(torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype))


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """The final logits as cap * tanh(logits / cap) (Gemma 2's final_logit_softcapping)."""
    if not cap:
        return logits
    return torch.tanh(logits / cap) * cap


def norm_parameters(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of every Gemma norm weight: kept in fp32, 1 added once loaded."""
    found = [(model, "norm")]
    for layer in model.layers:
        found += [(layer, name) for name in LAYER_NORMS]
        if layer.self_attn.qk_norm:
            found += [(layer.self_attn, "q_norm"), (layer.self_attn, "k_norm")]
    return found


def keep_norms_fp32(model: nn.Module) -> None:
    """HF multiplies by 1 + w in fp32: the norm weights stay fp32 in a 16-bit model."""
    for module, name in norm_parameters(model):
        old = getattr(module, name)
        setattr(module, name, nn.Parameter(old.detach().float(), requires_grad=False))


def add_one_to_norms(model: nn.Module) -> None:
    """The checkpoint's w -> 1 + w (fp32: the sum HF computes in every forward)."""
    with torch.no_grad():
        for module, name in norm_parameters(model):
            getattr(module, name).add_(1.0)


class GemmaDecoderLayer(nn.Module):
    """Gemma's sandwich: input norm, attention, post-attention norm, residual add; pre-MLP norm,
    MLP, post-MLP norm, residual add. The residual stream is carried apart (as DecoderLayer)."""

    def __init__(self, config, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn, self.mlp, self.eps = self_attn, mlp, config.rms_norm_eps
        for name in LAYER_NORMS:
            setattr(self, name, nn.Parameter(torch.ones(config.hidden_size)))

    def forward(self, rope, hidden, residual, k_cache, v_cache, meta: AttentionMetadata):
        """(hidden, residual) -> (MLP output, the residual before it); residual None in layer 0."""
        ops, eps = meta.fused_ops, self.eps
        if residual is None:
            residual, hidden = hidden, gemma_rms_norm(hidden, self.input_layernorm, eps, ops)[0]
        else:
            hidden, residual = gemma_rms_norm(hidden, self.input_layernorm, eps, ops, residual)
        hidden = self.self_attn(rope, hidden, k_cache, v_cache, meta)
        hidden = gemma_rms_norm(hidden, self.post_attention_layernorm, eps, ops)[0]
        hidden, residual = gemma_rms_norm(
            hidden, self.pre_feedforward_layernorm, eps, ops, residual
        )
        hidden = self.mlp(hidden, ops)
        return gemma_rms_norm(hidden, self.post_feedforward_layernorm, eps, ops)[0], residual
