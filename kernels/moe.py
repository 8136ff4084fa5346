"""Mixture-of-experts ops under vLLM's names: routing (`select_experts`), the block padding of
tokens sorted by expert (`align_block_size`) and the experts' two GEMMs (`fused_experts`), on
Triton or in PyTorch (the reference). design: docs/architecture.md#mixture-of-experts
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# How a family turns router logits into k experts and their weights.
TOPK_SOFTMAX = "topk_softmax"  # Mixtral: the k largest logits, softmax over those k
SOFTMAX_TOPK = "softmax_topk"  # Qwen2/3-MoE: softmax over all, the k largest (renormalized or not)
SCORINGS = (TOPK_SOFTMAX, SOFTMAX_TOPK)


def select_experts(
    logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [tokens, k], expert ids int64 [tokens, k]) from router logits [tokens, E].
    `renormalize` divides softmax_topk's k probabilities by their sum (Qwen's norm_topk_prob)."""
    logits = logits.float()
    if scoring == TOPK_SOFTMAX:
        values, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(values, dim=-1), ids
    assert scoring == SOFTMAX_TOPK, f"scoring must be one of {SCORINGS}, got {scoring!r}"
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's moe_align_block_size in PyTorch ops, with no host sync (CUDA-graph safe).

    The token slots (token * k + j, one per routed pair) sorted by expert, each expert's run
    padded to a multiple of `block_m` with the sentinel `tokens * k`: (sorted_ids int32
    [blocks * block_m], expert_ids int32 [blocks], num_padded int32 [1]). Blocks at or past
    num_padded are unused; `blocks` is the most any routing can need (at most min(E, slots)
    experts have tokens, each wasting under block_m rows)."""
    flat = topk_ids.reshape(-1)
    slots, device = flat.numel(), flat.device
    blocks = -(-(slots + min(num_experts, slots) * (block_m - 1)) // block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # slots by expert, in token order within one
    experts = flat[order]
    rank = torch.arange(slots, device=device) - (torch.cumsum(counts, 0) - counts)[experts]
    sorted_ids = torch.full((blocks * block_m,), slots, dtype=torch.int32, device=device)
    sorted_ids[(ends - padded)[experts] + rank] = order.to(torch.int32)
    starts = torch.arange(blocks, device=device) * block_m
    expert_ids = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), ends[-1:].to(torch.int32)


def swiglu_oai(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of h [..., 2I] = [gate | up] (transformers' GptOssExperts): the
    gate clamped to <= limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    ops: str = "torch",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    group_k: int = 0,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
) -> torch.Tensor:
    """sum_j weight_j * down_e(silu(gate_e(x)) * up_e(x)) over each token's k experts e = ids[j].
    x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]. ops: triton or torch. With
    scales (fp32 [E, N, groups], kernels.fp8's): w13 and w2 are FP8 e4m3 codes. gpt-oss: b13
    [E, 2I] and b2 [E, H] the projections' biases, `swiglu` (alpha, limit) its clamped
    activation (swiglu_oai) in place of SiLU-and-mul."""
    if ops == "triton":
        return _triton().fused_experts_triton(
            x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, group_k, b13, b2, swiglu
        )
    assert ops == "torch", f"ops must be triton or torch, got {ops!r}"
    if w13_scale is not None:
        w13 = dequantize_experts(w13, w13_scale, group_k)
        w2 = dequantize_experts(w2, w2_scale, group_k)
    return fused_experts_torch(x, w13, w2, topk_weights, topk_ids, b13, b2, swiglu)


def dequantize_experts(codes: torch.Tensor, scale: torch.Tensor, group_k: int) -> torch.Tensor:
    """FP8 experts' codes [E, N, K] times their scales [E, N, groups], in fp32."""
    from inferline.kernels.fp8 import dequantize

    e, n, k = codes.shape
    return dequantize(codes.reshape(e * n, k), scale.reshape(e * n, -1), group_k).view(e, n, k)


def fused_experts_torch(
    x, w13, w2, topk_weights, topk_ids, b13=None, b2=None, swiglu=None
) -> torch.Tensor:
    """The reference: every (token, expert) pair computed on its own gathered weights in fp32
    (memory T * k * the expert's size: for tests, not serving)."""
    h = torch.einsum("th,tkoh->tko", x.float(), w13[topk_ids].float())
    if b13 is not None:
        h = h + b13[topk_ids].float()
    if swiglu is not None:
        act = swiglu_oai(h, *swiglu)
    else:
        gate, up = h.chunk(2, dim=-1)
        act = F.silu(gate) * up
    y = torch.einsum("tki,tkhi->tkh", act, w2[topk_ids].float())
    if b2 is not None:
        y = y + b2[topk_ids].float()
    return (y * topk_weights.float()[..., None]).sum(dim=1).to(x.dtype)


@functools.cache
def _triton():
    """The launcher, imported on first use: TRITON_INTERPRET must be set first."""
    from inferline.kernels.triton import moe

    return moe
