"""FP8 (e4m3) weights: dequantization and the W8A16 linear layer, on Triton (a GPU, or the
interpreter for CPU tensors) or in PyTorch (the reference). A weight is its codes [N, K]
(torch.float8_e4m3fn) and fp32 scales [N, groups]: groups 1 (a scale per output row) or
ceil(K / group_k) (a scale per row and group_k-column block).
design: docs/architecture.md#fp8-weights
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from inferline.kernels.triton.launch import interpreting

FP8 = torch.float8_e4m3fn
DECODE_ROWS = 16  # the W8A16 kernel's small row tile takes up to this many rows, then 64


def dequantize(codes: torch.Tensor, scale: torch.Tensor, group_k: int = 0) -> torch.Tensor:
    """codes [N, K] times their scales [N, groups], in fp32."""
    if group_k:
        scale = scale.repeat_interleave(group_k, dim=1)[:, : codes.shape[1]]
    return codes.float() * scale.float()


def fp8_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    group_k: int = 0,
) -> torch.Tensor:
    """F.linear(x, dequantize(codes, scale, group_k), bias) in x's dtype: the Triton W8A16 kernel
    where Triton runs (CUDA, or the interpreter), else the PyTorch reference."""
    if x.is_cuda or interpreting():
        return _triton().w8a16_linear_triton(x, codes, scale, bias, group_k)
    return fp8_linear_torch(x, codes, scale, bias, group_k)


def fp8_linear_torch(x, codes, scale, bias=None, group_k: int = 0) -> torch.Tensor:
    """The reference: the weight dequantized in fp32, the product in fp32."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), dequantize(codes, scale, group_k), b).to(x.dtype)


@functools.cache
def _triton():
    """The launcher, imported on first use: TRITON_INTERPRET must be set first."""
    from inferline.kernels.triton import w8a16

    return w8a16
