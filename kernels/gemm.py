"""The linear layers' GEMM on the CPU, fp32 (csrc/gemm.c): y = x @ W.T + bias over a weight packed
once, at load, into panels of `panel_width()` output columns.

One of the three ways models/linear.py computes a linear layer on the CPU
(INFERLINE_MODEL__CPU_LINEAR): this one, oneDNN on its own packed copy, or F.linear. Each output
is one FMA chain over the inputs in order, so a row's result is the same bits alone, in any
batch and with any thread count (oneDNN needs a probe and a padded row for that: linear.py).
`auto` picks it where it was measured faster than oneDNN: x86 with AVX2 and without AVX-512 (an
AMD Zen 3: docs/benchmarks.md). Its AVX-512 build is tested for correctness, not tuned.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu

_F32 = torch.float32


@dataclass(frozen=True)
class PackedWeight:
    """A weight [out_features, in_features] as the C GEMM reads it: panels [ceil(out / width), in, width],
    each panel `width` output columns side by side for every input (zeros past out_features)."""
    panels: torch.Tensor
    out_features: int
    in_features: int


def available() -> bool:
    """The compiled kernels are built (built now if needed)."""
    return cpu.available()


def preferred() -> bool:
    """Whether INFERLINE_MODEL__CPU_LINEAR=auto uses this GEMM rather than oneDNN on this machine:
    where it was measured faster (AVX2 without AVX-512)."""
    flags = cpu.cpu_flags().split()
    return "avx2" in flags and "avx512f" not in flags and available()


def panel_width() -> int:
    return int(cpu.lib().gemm_panel_width())


def pack(weight: torch.Tensor) -> PackedWeight:
    """The packed copy of a CPU fp32 weight [out, in] (a second copy: the weight stays the model's)."""
    assert weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2, weight.dtype
    out_features, in_features = weight.shape
    width = panel_width()
    pad = -out_features % width
    padded = F.pad(weight.detach(), (0, 0, 0, pad)) if pad else weight.detach()  # no copy that is not needed
    panels = padded.reshape(-1, width, in_features).transpose(1, 2).contiguous()
    return PackedWeight(panels, out_features, in_features)


def gemm(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out] = F.linear(x, weight, bias), fp32 CPU; x's rows may be apart.
    ~120 calls a decode step: the checks are kept to attribute reads (cpu.call says why)."""
    if x.dim() != 2:
        return gemm(x.reshape(-1, x.shape[-1]), packed, bias).view(*x.shape[:-1], packed.out_features)
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, in_features = x.shape
    out = packed.out_features
    assert in_features == packed.in_features and x.dtype is _F32 and x.is_cpu, (x.shape, x.dtype, packed.in_features)
    assert bias is None or (bias.dtype is _F32 and bias.is_contiguous() and bias.numel() == out), "bias: fp32 [out]"
    y = torch.empty(rows, out, dtype=_F32)
    if rows:
        cpu.call("gemm_f32", x.data_ptr(), x.stride(0), packed.panels.data_ptr(),
                 None if bias is None else bias.data_ptr(), y.data_ptr(), out, rows, out, in_features,
                 torch.get_num_threads())
    return y
