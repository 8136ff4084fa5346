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
    if getattr(config, "original_max_position_embeddings", None):  # Phi-3 keeps it at the top
        params.setdefault(
            "original_max_position_embeddings", config.original_max_position_embeddings
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor below 1 is not supported")
    return params


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers masks them: a config's
    `layer_types` ("sliding_attention" layers get `sliding_window`), else `sliding_window` on
    every layer (Mistral; Qwen2/3 set it only with use_sliding_window)."""
    window = getattr(config, "sliding_window", None) or None
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return [window if kind == "sliding_attention" else None for kind in types]
    return [window] * config.num_hidden_layers


def rope_inv_freq(head_dim: int, params: dict, config=None, seq_len: int | None = None):
    """(inv_freq fp32, attention factor) as transformers' rope init functions make them;
    `seq_len`: the sequence length the dynamic kinds (dynamic, longrope) scale for."""
    base = params["rope_theta"]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (base**exponents)
    kind, factor = params["rope_type"], 1.0
    if kind == "linear":
        inv_freq = inv_freq / params["factor"]
    elif kind == "llama3":
        inv_freq = llama3_scale(inv_freq, params)
    elif kind == "yarn":
        inv_freq, factor = yarn_scale(inv_freq, head_dim, params, config)
    elif kind == "dynamic":
        inv_freq = 1.0 / (dynamic_base(head_dim, params, config, seq_len) ** exponents)
    elif kind == "longrope":
        inv_freq, factor = longrope_scale(inv_freq, params, config, seq_len)
    elif kind != "default":
        raise ValueError(f"unsupported rope_type {kind!r} (supported: {ROPE_TYPES})")
    return inv_freq.float(), factor


def dynamic_base(head_dim: int, params: dict, config, seq_len):
    """Dynamic NTK: the base grows once the sequence outgrows max_position_embeddings (seq_len an
    int, or a float64 tensor of them)."""
    max_len = config.max_position_embeddings
    if isinstance(seq_len, torch.Tensor):
        seq_len = seq_len.clamp_min(max_len)
    else:
        seq_len = max(seq_len or max_len, max_len)
    factor = params["factor"]
    return params["rope_theta"] * ((factor * seq_len / max_len) - (factor - 1)) ** (
        head_dim / (head_dim - 2)
    )


def past_inv_freq(head_dim: int, params: dict, config, positions: torch.Tensor) -> torch.Tensor:
    """[len(positions), head_dim / 2] fp32: each position's frequencies under a dynamic kind,
    scaled for a sequence that ends there (rope_threshold)."""
    if params["rope_type"] == "longrope":
        long = rope_inv_freq(head_dim, params, config, int(positions[-1]) + 1)[0]
        return long.expand(len(positions), -1)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    base = dynamic_base(head_dim, params, config, positions.double() + 1)
    return (1.0 / base[:, None] ** exponents[None, :]).float()


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_scale(inv_freq: torch.Tensor, dim: int, p: dict, config):
    """YaRN: frequencies blended between interpolated and kept along a linear ramp of the
    dimensions; cos and sin scaled by the attention factor."""
    base, old_len = p["rope_theta"], p["original_max_position_embeddings"]
    factor = p.get("factor") or config.max_position_embeddings / old_len
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = (
            yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
            if mscale and mscale_all
            else yarn_mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the share of each frequency extrapolated (kept as it is)
    return inv_freq / factor * (1 - kept) + inv_freq * kept, float(attention)


def longrope_scale(inv_freq: torch.Tensor, p: dict, config, seq_len: int | None):
    """LongRoPE (Phi-3): per-frequency divisors, `long_factor` once the sequence outgrows
    original_max_position_embeddings, `short_factor` before; cos and sin scaled by the
    attention factor."""
    old_len = p["original_max_position_embeddings"]
    factor = p.get("factor") or config.max_position_embeddings / old_len
    attention = p.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    long = seq_len is not None and seq_len > old_len
    ext = torch.tensor(p["long_factor" if long else "short_factor"], dtype=torch.float64)
    return inv_freq / ext, float(attention)


def length_limit(config) -> int:
    """The longest sequence the model takes: max_position_embeddings, past which dynamic NTK
    rope is made to scale (then no limit)."""
    if rope_parameters(config)["rope_type"] == "dynamic":
        return 1 << 30
    return getattr(config, "max_position_embeddings", 1 << 30)


def rope_threshold(params: dict, config) -> int | None:
    """The length past which a dynamic rope kind rescales (None: a static kind). transformers
    scales a forward pass by its longest position; the tables here scale each position by its
    own, which is the same for decode steps and for prompts within the threshold."""
    if params["rope_type"] == "dynamic":
        return config.max_position_embeddings
    if params["rope_type"] == "longrope":
        return params["original_max_position_embeddings"]
    return None


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

    def __init__(self, head_dim: int, max_positions: int, params: dict, config=None):
        super().__init__()
        self.max_positions = max_positions
        with torch.device("cpu"):  # fp32 on the CPU, whatever the build device (meta too)
            # attributes: never cast or moved
            self.inv_freq, self.attention_factor = rope_inv_freq(head_dim, params, config)
            self.threshold = rope_threshold(params, config)
            # a dynamic kind: positions past the threshold, each with its own scaling
            self.inv_freq_past = (
                None
                if self.threshold is None or max_positions <= self.threshold
                else past_inv_freq(
                    head_dim, params, config, torch.arange(self.threshold, max_positions)
                )
            )
        cos, sin = self._tables(torch.empty(0).device, torch.float32)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(
        self, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, self.inv_freq.to(device))
        if self.inv_freq_past is not None:
            past = positions[self.threshold :, None] * self.inv_freq_past.to(device)
            freqs = torch.cat((freqs[: self.threshold], past))
        cos, sin = freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
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
    def __init__(self, config, window: int | None = None):
        super().__init__()
        self.window = window  # sliding window: keys p - window < j <= p; None: all
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
        out = meta.backend.forward(q, k_cache, v_cache, meta, self.scale, self.window)
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

    def __init__(self, config, layer_idx: int = 0, window: int | None = None):
        super().__init__()
        self.self_attn = Attention(config, window)
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
        self.rotary = RotaryEmbedding(head_dim, max_positions, rope_parameters(config), config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.windows = layer_windows(config)
        self.layers = nn.ModuleList(DecoderLayer(config, i, w) for i, w in enumerate(self.windows))
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
