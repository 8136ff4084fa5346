"""Coded weights: dequantization and the W8A16 linear layer, on Triton (a GPU, or the interpreter
for CPU tensors) or in PyTorch (the reference). A weight is its codes [N, K] and fp32 scales
[N, groups]: FP8 e4m3 codes (torch.float8_e4m3fn) with groups 1 (a scale per output row) or
ceil(K / group_k) (a scale per row and group_k-column block); or a GGUF's uint8 levels with a
scale and an offset [N, K / group_k] per group (w = scale * level + offset).
design: docs/architecture.md#fp8-weights
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from inferline.kernels.triton.launch import interpreting

FP8 = torch.float8_e4m3fn
DECODE_ROWS = 16  # the W8A16 kernel's small row tile takes up to this many rows, then 64


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, group_k: int = 0, offset: torch.Tensor | None = None
) -> torch.Tensor:
    """codes [N, K] times their scales [N, groups] (plus the offsets of uint8 levels), in fp32."""
    if group_k:
        scale = scale.repeat_interleave(group_k, dim=1)[:, : codes.shape[1]]
    w = codes.float() * scale.float()
    if offset is not None:
        w = w + offset.repeat_interleave(group_k, dim=1)[:, : codes.shape[1]].float()
    return w


def fp8_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    group_k: int = 0,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, dequantize(codes, scale, group_k, offset), bias) in x's dtype: the Triton
    W8A16 kernel where Triton runs (CUDA, or the interpreter), else the PyTorch reference."""
    if x.is_cuda or interpreting():
        return _triton().w8a16_linear_triton(x, codes, scale, bias, group_k, offset)
    return fp8_linear_torch(x, codes, scale, bias, group_k, offset)


def fp8_linear_torch(x, codes, scale, bias=None, group_k: int = 0, offset=None) -> torch.Tensor:
    """The reference: the weight dequantized in fp32, the product in fp32."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), dequantize(codes, scale, group_k, offset), b).to(x.dtype)


@functools.cache
def _triton():
    """The launcher, imported on first use: TRITON_INTERPRET must be set first."""
    from inferline.kernels.triton import w8a16

    return w8a16
