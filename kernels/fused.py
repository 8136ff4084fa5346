"""Fused elementwise ops of the decoder layer under vLLM's names, run as `ops` says: torch (the
reference), c or triton. design: docs/architecture.md#kernels
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import functools

from inferline import kernels
from inferline.kernels.cpu import attention, build

OPS = ("c", "triton", "torch")


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """The C kernels take tensors of this device and dtype, and are built (now if needed)."""
    return device.type == "cpu" and dtype == torch.float32 and build.available()


# The C paths run ~150 times a decode step: their checks are kept to attribute reads.
_F32 = torch.float32


def _rows(x: torch.Tensor) -> int:
    """The row stride of a 2-D view with packed rows (a slice of a wider row is fine)."""
    assert x.dim() == 2 and x.stride(1) == 1, (
        f"rows must be packed: shape {tuple(x.shape)}, strides {x.stride()}"
    )
    return x.stride(0)


@functools.cache
def _triton():
    """The Triton launchers, imported on first use: TRITON_INTERPRET must be set first."""
    from inferline.kernels.triton import activation, norm, rotary

    return activation, norm, rotary


def _check(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.dtype is _F32 and t.is_cpu, (t.dtype, t.device)


# ---- RMSNorm -------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, ops: str = "torch") -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim (HF's LlamaRMSNorm)."""
    if ops == "triton":
        return _triton()[1].rms_norm_triton(x, weight, eps)
    if ops != "c":
        assert ops == "torch", f"ops must be one of {OPS}, got {ops!r}"
        return rms_norm_torch(x, weight, eps)
    _check(x, weight)
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=_F32)
    build.call(
        "rms_norm_f32",
        x.data_ptr(),
        _rows(x),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        cols,
        eps,
        torch.get_num_threads(),
    )
    return out


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    if dtype == torch.float32:  # one op, the same arithmetic
        return F.rms_norm(x, weight.shape, weight, eps)
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, ops: str = "torch"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the C and Triton paths update `residual` in place."""
    if ops == "triton":
        return _triton()[1].rms_norm_triton(x, weight, eps, residual), residual
    if ops != "c":
        assert ops == "torch", f"ops must be one of {OPS}, got {ops!r}"
        residual = x + residual
        return rms_norm_torch(residual, weight, eps), residual
    _check(x, residual, weight)
    rows, cols = x.shape
    assert residual.is_contiguous() and residual.shape == x.shape, (residual.shape, x.shape)
    out = torch.empty((rows, cols), dtype=_F32)
    build.call(
        "fused_add_rms_norm_f32",
        x.data_ptr(),
        _rows(x),
        residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        cols,
        eps,
        torch.get_num_threads(),
    )
    return out, residual


def gemma_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, ops: str = "torch", residual=None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gemma's RMSNorm, `weight` holding 1 + w in fp32 (the loader adds the 1): normalized and
    multiplied in fp32, rounded once (HF's Gemma2RMSNorm); with `residual`, of x + residual, as
    fused_add_rms_norm. Returns (out, the new residual or None). fp32 x goes to the kernels of
    `ops` (the same arithmetic); 16-bit x to PyTorch (the kernels round before the weight)."""
    if x.dtype == torch.float32:
        if residual is None:
            return rms_norm(x, weight, eps, ops), None
        return fused_add_rms_norm(x, residual, weight, eps, ops)
    if residual is not None:
        x = residual = x + residual
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype), residual


# ---- MLP activation ------------------------------------------------------------------------------


def silu_and_mul(x: torch.Tensor, ops: str = "torch") -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dim."""
    if ops == "triton":
        return _triton()[0].silu_and_mul_triton(x)
    if ops != "c":
        assert ops == "torch", f"ops must be one of {OPS}, got {ops!r}"
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
    _check(x)
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=_F32)
    build.call(
        "silu_and_mul_f32",
        x.data_ptr(),
        _rows(x),
        out.data_ptr(),
        rows,
        inter,
        torch.get_num_threads(),
    )
    return out


def gelu_tanh_and_mul(x: torch.Tensor, ops: str = "torch") -> torch.Tensor:
    """gelu_tanh(gate) * up for x = [gate | up] (Gemma's `gelu_pytorch_tanh`): PyTorch on every
    `ops` (no fused kernel yet)."""
    assert ops in OPS, f"ops must be one of {OPS}, got {ops!r}"
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


# ---- rotary embedding + K/V store ----------------------------------------------------------------


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox / HF "rotate_half" layout, x [tokens, heads, head_dim]; cos, sin [tokens, 1, head_dim]:
    with cos = (c, c), sin = (-s, s), x * cos + swap_halves(x) * sin is exactly HF's."""
    xf = x.float()
    swapped = xf.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return (xf * cos).add_(swapped * sin).to(x.dtype)


def rope_store_kv(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    ops: str = "torch",
    store=None,
) -> torch.Tensor:
    """Rotate the q and k heads of qkv [tokens, (num_heads + 2 num_kv_heads) * head_dim], store k
    and v at slot_mapping (negative: skipped), return the rotated q [tokens, num_heads, head_dim]
    (in place in qkv on the C and Triton paths)."""
    if ops == "triton":
        return _triton()[2].rope_store_kv_triton(
            qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slot_mapping
        )
    assert ops in OPS, f"ops must be one of {OPS}, got {ops!r}"
    tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if ops == "torch" or (
        k_cache.dtype is torch.float16 and not attention.supports_kv_half(head_dim)
    ):
        qk = rotate(
            qkv[:, : q_size + kv_size].view(tokens, num_heads + num_kv_heads, head_dim), cos, sin
        )
        v = qkv[:, q_size + kv_size :].view(tokens, num_kv_heads, head_dim)
        (store or kernels.store_kv)(qk[:, num_heads:], v, k_cache, v_cache, slot_mapping)
        return qk[:, :num_heads]
    _check(qkv, cos, sin)
    assert (
        k_cache.dtype in attention.KV_DTYPES and k_cache.dtype == v_cache.dtype and k_cache.is_cpu
    ), k_cache.dtype
    assert qkv.shape[1] == q_size + 2 * kv_size and head_dim % 2 == 0, (
        qkv.shape,
        num_heads,
        num_kv_heads,
    )
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert (
        slot_mapping.dtype is torch.int64
        and slot_mapping.is_contiguous()
        and slot_mapping.shape[0] == tokens
    )
    # [tokens, 1, head_dim] or [tokens, head_dim], packed: the same rows in memory
    assert (
        cos.is_contiguous()
        and sin.is_contiguous()
        and cos.numel() == sin.numel() == tokens * head_dim
    )
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    rc = build.call(
        "rope_store_kv_f32",
        qkv.data_ptr(),
        _rows(qkv),
        cos.data_ptr(),
        sin.data_ptr(),
        tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        num_slots,
        torch.get_num_threads(),
        int(k_cache.dtype is torch.float16),
    )
    if rc != 0:
        raise RuntimeError(
            f"rope_store_kv_f32: "
            + (
                f"a slot past the cache's {num_slots} slots"
                if rc == -2
                else f"head_dim {head_dim} or K/V dtype {k_cache.dtype} it does not take"
            )
        )
    return qkv[:, :q_size].view(tokens, num_heads, head_dim)
