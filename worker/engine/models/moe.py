"""The sparse MoE block of Mixtral, Qwen2-MoE, Qwen3-MoE and gpt-oss: a router, the experts'
weights stacked per layer ([E, ...]), Qwen2-MoE's sigmoid-gated shared expert, gpt-oss's biases
(router and experts) and clamped SwiGLU. On CUDA (fused ops on
Triton) the experts run as the fused-MoE kernel; elsewhere tokens are grouped by expert and each
expert with tokens runs on the project's linear layer (packed GEMM on the CPU).
design: docs/architecture.md#mixture-of-experts
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from inferline.kernels.fp8 import FP8, dequantize
from inferline.kernels.fused import silu_and_mul
from inferline.kernels.moe import (
    SOFTMAX_TOPK,
    TOPK_SOFTMAX,
    fused_experts,
    select_experts,
    swiglu_oai,
)
from inferline.worker.engine.models.linear import Linear, Packed, linear, pack_weight

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")


@dataclass(frozen=True)
class MoeSpec:
    """A family's experts: how many, how routed, and the checkpoint's names for them."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    scoring: str  # kernels.moe.TOPK_SOFTMAX or SOFTMAX_TOPK
    renormalize: bool  # the k weights divided by their sum (softmax_topk only)
    shared_intermediate_size: int  # 0: no shared expert
    prefix: str  # the block's name in a layer: "mlp." or Mixtral's "block_sparse_moe."
    names: tuple[str, str, str]  # an expert's gate, up and down projections
    # gpt-oss: the router and every expert projection have biases; the checkpoint stacks the
    # experts as [E, in, out] with gate and up columns interleaved (gate_up_proj); the activation
    # is the clamped SwiGLU (kernels.moe.swiglu_oai) of these (alpha, limit); None: SiLU-and-mul
    stacked: bool = False
    swiglu: tuple[float, float] | None = None


def moe_spec(config) -> MoeSpec | None:
    """The config's MoE settings; None for a dense family."""
    kind = config.model_type
    if kind == "mixtral":
        return MoeSpec(config.num_local_experts, config.num_experts_per_tok,
                       config.intermediate_size, TOPK_SOFTMAX, True, 0,
                       "block_sparse_moe.", ("w1", "w3", "w2"))  # fmt: skip
    if kind in ("qwen2_moe", "qwen3_moe"):
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        return MoeSpec(config.num_experts, config.num_experts_per_tok,
                       config.moe_intermediate_size, SOFTMAX_TOPK, bool(config.norm_topk_prob),
                       shared if kind == "qwen2_moe" else 0, "mlp.",
                       ("gate_proj", "up_proj", "down_proj"))  # fmt: skip
    if kind == "gpt_oss":
        return MoeSpec(config.num_local_experts, config.num_experts_per_tok,
                       config.intermediate_size, TOPK_SOFTMAX, False, 0, "mlp.",
                       ("gate_up_proj", "gate_up_proj", "down_proj"), stacked=True,
                       swiglu=(float(config.swiglu_alpha), float(config.swiglu_limit)))  # fmt: skip
    return None


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Whether layer `layer_idx` has experts (Qwen's mlp_only_layers and decoder_sparse_step keep
    some layers dense, with the config's intermediate_size)."""
    spec = moe_spec(config)
    if spec is None or spec.num_experts == 0:
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer_idx not in (getattr(config, "mlp_only_layers", None) or ()) and (
        (layer_idx + 1) % step == 0
    )


class SparseMoeBlock(nn.Module):
    """Routed experts (plus the shared expert given, for Qwen2-MoE) in place of the dense MLP.
    w13 [E, 2I, H] holds each expert's gate rows then its up rows; w2 [E, H, I] its down; with
    biases (gpt-oss) b13 [E, 2I] and b2 [E, H] in the same order."""

    def __init__(self, config, spec: MoeSpec, shared_expert: nn.Module | None = None):
        super().__init__()
        hidden, inter, experts = config.hidden_size, spec.intermediate_size, spec.num_experts
        self.spec = spec
        self.gate = Linear(hidden, experts, bias=spec.stacked)  # the router
        self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, inter))
        self.b13 = nn.Parameter(torch.empty(experts, 2 * inter)) if spec.stacked else None
        self.b2 = nn.Parameter(torch.empty(experts, hidden)) if spec.stacked else None
        self.shared_expert = shared_expert
        self.shared_expert_gate = Linear(hidden, 1, bias=False) if shared_expert else None
        self.packed13: list[Packed] | None = None
        self.packed2: list[Packed] | None = None
        self.group_k = 0  # coded experts: the scale groups' width (0: one scale per row)

    def use_fp8(self, group_k: int = 0) -> None:
        """Hold the experts as e4m3 codes beside fp32 scales [E, N, groups] (`w13_scale`,
        `w2_scale`), unset, on the weights' device (meta before `to_empty`): an FP8 checkpoint's
        experts for the fused-MoE kernel's W8A16 variant."""
        for name in ("w13", "w2"):
            e, n, k = getattr(self, name).shape
            device = getattr(self, name).device
            codes = torch.empty(e, n, k, dtype=FP8, device=device)
            setattr(self, name, nn.Parameter(codes, requires_grad=False))
            groups = -(-k // group_k) if group_k else 1
            self.register_buffer(name + "_scale", torch.empty(e, n, groups, device=device))
        self.group_k = group_k

    def coded(self) -> bool:
        """Whether the experts hold FP8 codes."""
        return self.w13.dtype == FP8

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's (w13, w2), dequantized to fp32 if coded (the grouped path's)."""
        if not self.coded():
            return self.w13[expert], self.w2[expert]
        return tuple(
            dequantize(getattr(self, n)[expert], getattr(self, n + "_scale")[expert], self.group_k)
            for n in ("w13", "w2")
        )

    def pack(self, backend: str = "onednn", codes: bool = False) -> bool:
        """Pack every expert's two weights for the CPU GEMM (the router and shared expert are
        Linear layers the model packs itself); False where packing does not apply."""
        p13 = [pack_weight(w, backend, codes) for w in self.w13.detach()]
        p2 = [pack_weight(w, backend, codes) for w in self.w2.detach()]
        ok = all(p is not None for p in p13 + p2)
        self.packed13, self.packed2 = (p13, p2) if ok else (None, None)
        return ok

    def packed_experts(self) -> list[Packed]:
        return [*(self.packed13 or ()), *(self.packed2 or ())]

    def forward(self, x: torch.Tensor, ops: str = "torch") -> torch.Tensor:
        spec = self.spec
        weights, ids = select_experts(self.gate(x), spec.top_k, spec.scoring, spec.renormalize)
        if ops == "triton":
            coded = (self.w13_scale, self.w2_scale, self.group_k) if self.coded() else (None,) * 2
            out = fused_experts(x, self.w13, self.w2, weights, ids, "triton", *coded,
                                b13=self.b13, b2=self.b2, swiglu=spec.swiglu)  # fmt: skip
        else:
            out = self.grouped_experts(x, weights, ids, ops)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x, ops)
        return out

    def grouped_experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ops: str
    ) -> torch.Tensor:
        """Tokens grouped by expert, one GEMM pair per expert that has tokens, summed in fp32 in
        expert order (as transformers' experts loop)."""
        top_k, out = ids.shape[1], torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.spec.num_experts).tolist()
        flat_weights, start = weights.reshape(-1), 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            slots = order[start : start + count]
            start += count
            tokens = slots // top_k
            p13 = self.packed13[expert] if self.packed13 else None
            p2 = self.packed2[expert] if self.packed2 else None
            w13, w2 = self.expert_weights(expert)
            b13, b2 = (None, None) if self.b13 is None else (self.b13[expert], self.b2[expert])
            h = linear(x[tokens], w13.to(x.dtype), b13, packed=p13)
            act = (
                silu_and_mul(h, ops)
                if self.spec.swiglu is None
                else swiglu_oai(h, *self.spec.swiglu)
            )
            y = linear(act, w2.to(x.dtype), b2, packed=p2)
            out.index_add_(0, tokens, y.float() * flat_weights[slots, None])
        return out.to(x.dtype)

    def from_stacked_checkpoint(self) -> None:
        """gpt-oss, once its checkpoint is read in (moe_destinations): each expert's gate_up_proj
        [H, 2I] with gate and up columns interleaved becomes gate rows then up rows [2I, H], its
        down_proj [I, H] becomes [H, I], its gate_up bias is de-interleaved too; one expert at a
        time (a copy of one expert beside the model)."""
        inter, hidden = self.spec.intermediate_size, self.w13.shape[2]
        with torch.no_grad():
            for e in range(self.spec.num_experts):
                raw = self.w13[e].view(hidden, 2 * inter).clone()
                self.w13[e].copy_(torch.cat((raw[:, 0::2].t(), raw[:, 1::2].t())))
                self.w2[e].copy_(self.w2[e].view(inter, hidden).t().clone())
                bias = self.b13[e].clone()
                self.b13[e].copy_(torch.cat((bias[0::2], bias[1::2])))


def warmup_prompt_tokens(model: nn.Module) -> int:
    """A prompt length whose token slots take the fused-MoE kernel's prefill-sized plan (more
    slots than twice the experts: kernels.triton.moe.block_m_for); 0 for a dense model."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    return max((2 * b.spec.num_experts // b.spec.top_k + 1 for b in blocks), default=0)


def moe_destinations(params: dict, block: SparseMoeBlock, src: str, dst: str) -> dict:
    """HF checkpoint name -> the part of the block's parameters it fills, for one layer; `src`
    and `dst` are the layer's prefixes. Experts are stored one tensor per projection."""
    spec, src, dst = block.spec, src + block.spec.prefix, dst + "mlp."
    inter, (gate, up, down) = spec.intermediate_size, spec.names
    w13, w2 = params[dst + "w13"], params[dst + "w2"]
    if spec.stacked:  # gpt-oss: read in its own layout, reordered by from_stacked_checkpoint
        experts, hidden = spec.num_experts, w13.shape[2]
        return {
            src + "router.weight": params[dst + "gate.weight"],
            src + "router.bias": params[dst + "gate.bias"],
            src + "experts.gate_up_proj": w13.view(experts, hidden, 2 * inter),
            src + "experts.gate_up_proj_bias": params[dst + "b13"],
            src + "experts.down_proj": w2.view(experts, inter, hidden),
            src + "experts.down_proj_bias": params[dst + "b2"],
        }
    out = {src + "gate.weight": params[dst + "gate.weight"]}
    for e in range(spec.num_experts):
        out[f"{src}experts.{e}.{gate}.weight"] = w13[e, :inter]
        out[f"{src}experts.{e}.{up}.weight"] = w13[e, inter:]
        out[f"{src}experts.{e}.{down}.weight"] = w2[e]
    if block.shared_expert is not None:
        shared = block.shared_expert.intermediate_size
        gate_up = params[dst + "shared_expert.gate_up_proj.weight"]
        out[src + "shared_expert.gate_proj.weight"] = gate_up[:shared]
        out[src + "shared_expert.up_proj.weight"] = gate_up[shared:]
        out[src + "shared_expert.down_proj.weight"] = params[dst + "shared_expert.down_proj.weight"]
        out[src + "shared_expert_gate.weight"] = params[dst + "shared_expert_gate.weight"]
    return out
