"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2; with sparse MoE blocks:
Mixtral, Qwen2-MoE, Qwen3-MoE) over the paged KV cache.
design: docs/architecture.md#the-model
"""

from __future__ import annotations

import math

import torch
from torch import nn

from inferline.kernels.attention import AttentionMetadata
from inferline.kernels.fused import fused_add_rms_norm, rms_norm, rope_store_kv, silu_and_mul
from inferline.worker.engine.models.linear import Linear, Packed, linear, pack_weight
from inferline.worker.engine.models.moe import SparseMoeBlock, is_sparse_layer, moe_spec


def rope_parameters(config) -> dict:
    """transformers 5 keeps rope settings in `rope_parameters`; 4.x in rope_theta/rope_scaling."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling = getattr(config, "rope_scaling", None) or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    base = params["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = params["rope_type"]
    if kind == "linear":
        inv_freq = inv_freq / params["factor"]
    elif kind == "llama3":
        inv_freq = llama3_scale(inv_freq, params)
    elif kind != "default":
        raise ValueError(f"unsupported rope_type {kind!r}")
    return inv_freq.float()


def llama3_scale(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1 long-context scaling: long wavelengths divided by `factor`, short ones kept,
    blended in between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    middle = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(middle, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Neox / HF "rotate_half" layout: tables hold cos = (c, c) and sin = (-s, s)
    (kernels.fused.rotate)."""

    def __init__(self, head_dim: int, max_positions: int, params: dict):
        super().__init__()
        self.max_positions = max_positions
        with torch.device("cpu"):  # fp32 on the CPU, whatever the build device (meta too)
            self.inv_freq = rope_inv_freq(head_dim, params)  # an attribute: never cast or moved
        cos, sin = self._tables(torch.empty(0).device, torch.float32)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(
        self, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(
            torch.arange(self.max_positions, dtype=torch.float32, device=device),
            self.inv_freq.to(device),
        )
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)

    def fill(self) -> None:
        """Compute the tables into the buffers (unset after meta + to_empty), in their dtype."""
        cos, sin = self._tables(self.cos.device, self.cos.dtype)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [num_tokens, 1, head_dim], shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        bias = (
            getattr(config, "attention_bias", False)
            or getattr(config, "qkv_bias", False)  # Qwen2-MoE
            or config.model_type == "qwen2"
        )
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(self.head_dim))
            self.k_norm = nn.Parameter(torch.ones(self.head_dim))

    def forward(self, rope, hidden, k_cache, v_cache, meta: AttentionMetadata):
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if self.qk_norm:
            self._norm_qk(qkv)
        q = rope_store_kv(
            qkv,
            self.num_heads,
            self.num_kv_heads,
            *rope,
            k_cache,
            v_cache,
            meta.slot_mapping,
            ops=meta.fused_ops,
            store=meta.backend.store_kv,
        )
        out = meta.backend.forward(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.view(num_tokens, self.q_size))

    def _norm_qk(self, qkv: torch.Tensor) -> None:
        """Qwen3: q and k heads RMS-normalized before the rotation, in place."""
        heads = self.num_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(
            qkv.shape[0], heads + self.num_kv_heads, self.head_dim
        )
        qk[:, :heads] = rms_norm(qk[:, :heads], self.q_norm, self.eps)
        qk[:, heads:] = rms_norm(qk[:, heads:], self.k_norm, self.eps)


class MLP(nn.Module):
    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        self.intermediate_size = inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=False)
        self.down_proj = Linear(inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: str = "torch") -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), ops))


class DecoderLayer(nn.Module):
    """Carries the residual stream apart from the sublayers' outputs (as vLLM), so each output
    joins it in the pass that normalizes the sum."""

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = make_mlp(config, layer_idx)
        self.input_layernorm = nn.Parameter(torch.ones(config.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(config.hidden_size))
        self.eps = config.rms_norm_eps

    def forward(self, rope, hidden, residual, k_cache, v_cache, meta: AttentionMetadata):
        """(hidden, residual) -> (MLP output, the residual before it); residual None in layer 0."""
        ops = meta.fused_ops
        if residual is None:
            residual, hidden = hidden, rms_norm(hidden, self.input_layernorm, self.eps, ops)
        else:
            hidden, residual = fused_add_rms_norm(
                hidden, residual, self.input_layernorm, self.eps, ops
            )
        hidden = self.self_attn(rope, hidden, k_cache, v_cache, meta)
        hidden, residual = fused_add_rms_norm(
            hidden, residual, self.post_attention_layernorm, self.eps, ops
        )
        return self.mlp(hidden, ops), residual


def make_mlp(config, layer_idx: int) -> nn.Module:
    """The dense MLP, or the sparse MoE block where the family has experts in this layer."""
    if not is_sparse_layer(config, layer_idx):
        return MLP(config)
    spec = moe_spec(config)
    shared = spec.shared_intermediate_size
    return SparseMoeBlock(config, spec, MLP(config, shared) if shared else None)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.rotary = RotaryEmbedding(head_dim, max_positions, rope_parameters(config))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head_packed: Packed | None = None

    def pack_linears(self, backend: str = "onednn", codes: bool = False) -> bool:
        """Give every linear layer and the LM head a packed weight for `backend` once loaded;
        False where packing does not apply (not CPU fp32)."""
        packable = (Linear, SparseMoeBlock)  # an MoE block packs its stacked experts
        packed = [m.pack(backend, codes) for m in self.modules() if isinstance(m, packable)]
        tied = self.tie_word_embeddings  # no Linear for a tied head: pack it here
        self.lm_head_packed = (
            pack_weight(self.embed_tokens.weight, backend, codes) if tied else self.lm_head.packed
        )
        return all(packed) and self.lm_head_packed is not None

    def packed_weights(self) -> list:
        linears = [m.packed for m in self.modules() if isinstance(m, Linear)]
        experts = [p for m in self.modules() if isinstance(m, SparseMoeBlock)
                   for p in m.packed_experts()]  # fmt: skip
        return linears + experts + ([self.lm_head_packed] if self.tie_word_embeddings else [])

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of every token; `kv_cache[i]` is layer i's (k_cache, v_cache)."""
        hidden, residual = self.embed_tokens(input_ids), None  # a new tensor: in place is fine
        rope = self.rotary.tables(positions)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_cache):
            hidden, residual = layer(rope, hidden, residual, k_cache, v_cache, meta)
        return fused_add_rms_norm(
            hidden, residual, self.norm, self.config.rms_norm_eps, meta.fused_ops
        )[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head_weight(), packed=self.lm_head_packed)
