"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3/4, SmolLM2; Gemma 2 and 3 with
their sandwich norms, gemma.py; with sparse MoE blocks: Mixtral, Qwen2-MoE, Qwen3-MoE, and
gpt-oss with its attention sinks and biased projections) over the paged KV cache.
design: docs/architecture.md#the-model
"""

from __future__ import annotations

import math

import torch
from torch import nn

from inferline.kernels.attention import AttentionMetadata
from inferline.kernels.fused import (
    fused_add_rms_norm,
    gelu_tanh_and_mul,
    gemma_rms_norm,
    rms_norm,
    rope_store_kv,
    silu_and_mul,
)
from inferline.worker.engine.models import gemma
from inferline.worker.engine.models.linear import Linear, Packed, linear, pack_weight
from inferline.worker.engine.models.moe import SparseMoeBlock, is_sparse_layer, moe_spec


def rope_parameters(config, layer_type: str = "full_attention") -> dict:
    """transformers 5 keeps rope settings in `rope_parameters`; 4.x in rope_theta/rope_scaling.
    Gemma 3 keeps one set per layer type (its local layers' base: rope_local_base_freq)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "full_attention" in params or "sliding_attention" in params:
        params = dict(params.get(layer_type) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling = getattr(config, "rope_scaling", None) or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    params.setdefault("rope_type", params.get("type", "default"))
    if getattr(config, "original_max_position_embeddings", None):  # Phi-3 keeps it at the top
        params.setdefault(
            "original_max_position_embeddings", config.original_max_position_embeddings
        )
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return params


def rotary_dim(head_dim: int, params: dict) -> int:
    """The head dims rope rotates (Phi-4-mini's partial_rotary_factor 0.75: the first 3/4)."""
    return int(head_dim * (params.get("partial_rotary_factor") or 1.0))


def rotary_order(head_dim: int, rot: int) -> torch.Tensor | None:
    """Partial rotary as full: the order the loader puts each q and k head's dims in (the same for
    both, so q.k is unchanged) that moves the rotated pairs (i, i + rot/2) to (j, j + head_dim/2),
    the kept dims after them in each half; the tables leave the kept dims alone (cos 1, sin 0),
    so every rope kernel rotates halves of the whole head as before. None: all dims rotate."""
    if rot == head_dim:
        return None
    half, kept = rot // 2, list(range(rot, head_dim))
    return torch.tensor(
        [*range(half), *kept[: len(kept) // 2], *range(half, rot), *kept[len(kept) // 2 :]]
    )


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
        self.max_positions, self.head_dim = max_positions, head_dim
        rot = rotary_dim(head_dim, params)  # the rest: cos 1, sin 0 (rotary_order)
        with torch.device("cpu"):  # fp32 on the CPU, whatever the build device (meta too)
            # attributes: never cast or moved
            self.inv_freq, self.attention_factor = rope_inv_freq(rot, params, config)
            self.threshold = rope_threshold(params, config)
            # a dynamic kind: positions past the threshold, each with its own scaling
            self.inv_freq_past = (
                None
                if self.threshold is None or max_positions <= self.threshold
                else past_inv_freq(rot, params, config, torch.arange(self.threshold, max_positions))
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
        kept = self.head_dim // 2 - cos.shape[1]  # partial rotary: dims left as they are
        if kept:
            cos = torch.cat((cos, torch.ones_like(cos[:, :1]).expand(-1, kept)), dim=-1)
            sin = torch.cat((sin, torch.zeros_like(sin[:, :1]).expand(-1, kept)), dim=-1)
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
        self.gemma = gemma.is_gemma(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Gemma: query_pre_attn_scalar^-0.5, and the scores soft-capped (Gemma 2; 0: off)
        self.scale = (getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        self.softcap = float(getattr(config, "attn_logit_softcapping", None) or 0.0)
        self.eps = config.rms_norm_eps
        bias = (
            getattr(config, "attention_bias", False)
            or getattr(config, "qkv_bias", False)  # Qwen2-MoE
            or config.model_type == "qwen2"
        )
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        gpt_oss = config.model_type == "gpt_oss"  # o_proj's bias, and a sink per head
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=gpt_oss and bias)
        # gpt-oss's attention sinks: a logit per query head in each softmax (fp32, keep_fp32)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if gpt_oss else None
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe", "gemma3_text")
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
        out = meta.backend.forward(
            q, k_cache, v_cache, meta, self.scale, self.window, self.softcap, self.sinks
        )
        return self.o_proj(out.view(num_tokens, self.q_size))

    def _norm_qk(self, qkv: torch.Tensor) -> None:
        """Qwen3, Gemma 3: q and k heads RMS-normalized before the rotation, in place."""
        heads = self.num_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(
            qkv.shape[0], heads + self.num_kv_heads, self.head_dim
        )
        if self.gemma:  # 1 + w, in fp32
            qk[:, :heads] = gemma_rms_norm(qk[:, :heads], self.q_norm, self.eps)[0]
            qk[:, heads:] = gemma_rms_norm(qk[:, heads:], self.k_norm, self.eps)[0]
            return
        qk[:, :heads] = rms_norm(qk[:, :heads], self.q_norm, self.eps)
        qk[:, heads:] = rms_norm(qk[:, heads:], self.k_norm, self.eps)

    def order_rotary_dims(self, order: torch.Tensor) -> None:
        """Partial rotary: each q and k head's weight rows (and bias, q/k norm, and a coded
        weight's per-row scales and offsets) put in `order` (rotary_order), once loaded."""
        q, kv, d, proj = self.q_size, self.kv_size, self.head_dim, self.qkv_proj
        rows = ("weight", "bias", "weight_scale", "weight_offset")
        for param in (getattr(proj, name, None) for name in rows):
            if param is not None:
                qk = param.data[: q + kv]
                heads = qk.view(-1, d, *qk.shape[1:])
                heads.copy_(heads.index_select(1, order.to(heads.device)))
        if self.qk_norm:
            for norm in (self.q_norm, self.k_norm):
                norm.data.copy_(norm.data[order.to(norm.device)])


ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}


class MLP(nn.Module):
    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        self.intermediate_size = inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=False)
        self.down_proj = Linear(inter, config.hidden_size, bias=False)
        # Gemma names it hidden_activation
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r} (supported: {list(ACTIVATIONS)})")
        self.act_and_mul = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, ops: str = "torch") -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x), ops))


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


def make_layer(config, layer_idx: int, window: int | None) -> nn.Module:
    if gemma.is_gemma(config):
        return gemma.GemmaDecoderLayer(config, Attention(config, window), MLP(config))
    return DecoderLayer(config, layer_idx, window)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        self.head_dim = head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        params = rope_parameters(config)
        self.rotary = RotaryEmbedding(head_dim, max_positions, params, config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.windows = layer_windows(config)
        self.layers = nn.ModuleList(make_layer(config, i, w) for i, w in enumerate(self.windows))
        # Gemma 3: its local layers' own rope (rope_local_base_freq), a second table
        local = rope_parameters(config, "sliding_attention")
        types = getattr(config, "layer_types", None) or []
        self.local_rotary = (
            RotaryEmbedding(head_dim, max_positions, local, config) if local != params else None
        )
        self.local_layers = [t == "sliding_attention" and local != params for t in types] or [
            False
        ] * len(self.layers)
        self.gemma = gemma.is_gemma(config)
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

    def fill_tables(self) -> None:
        """The rope tables, computed into their buffers (unset after meta + to_empty)."""
        for rotary in (self.rotary, self.local_rotary):
            if rotary is not None:
                rotary.fill()

    def keep_fp32(self) -> None:
        """After a cast to the model dtype: Gemma's norm weights and gpt-oss's sinks back to
        fp32."""
        if self.gemma:
            gemma.keep_norms_fp32(self)
        for layer in self.layers:
            attn = layer.self_attn
            if attn.sinks is not None:
                attn.sinks = nn.Parameter(attn.sinks.detach().float(), requires_grad=False)

    def finish_load(self) -> None:
        """Once a checkpoint's tensors are in: Gemma's norms become 1 + w; partial rotary puts
        each q and k head's dims in rotary_order; gpt-oss's experts leave the checkpoint's
        layout."""
        if self.gemma:
            gemma.add_one_to_norms(self)
        for block in self.modules():
            if isinstance(block, SparseMoeBlock) and block.spec.stacked:
                block.from_stacked_checkpoint()
        order = rotary_order(self.head_dim, rotary_dim(self.head_dim, self.rotary_params()))
        if order is not None:
            for layer in self.layers:
                layer.self_attn.order_rotary_dims(order)

    def rotary_params(self) -> dict:
        return rope_parameters(self.config)

    def forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of every token; `kv_cache[i]` is layer i's (k_cache, v_cache)."""
        hidden, residual = self.embed_tokens(input_ids), None  # a new tensor: in place is fine
        if self.gemma:
            hidden = hidden * gemma.embed_scale(self.config, hidden.dtype)
        ropes = (self.rotary.tables(positions),)
        if self.local_rotary is not None:
            ropes += (self.local_rotary.tables(positions),)
        for layer, local, (k_cache, v_cache) in zip(self.layers, self.local_layers, kv_cache):
            hidden, residual = layer(ropes[local], hidden, residual, k_cache, v_cache, meta)
        eps, ops = self.config.rms_norm_eps, meta.fused_ops
        if self.gemma:
            return gemma_rms_norm(hidden, self.norm, eps, ops, residual)[0]
        return fused_add_rms_norm(hidden, residual, self.norm, eps, ops)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.lm_head_weight(), packed=self.lm_head_packed)
        return gemma.soft_cap(logits, getattr(self.config, "final_logit_softcapping", None))
