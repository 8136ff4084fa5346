"""Linear layers for the engine's models: F.linear, except for small batches on the CPU.

MKL's sgemm streams the weights far better when the product is taken weight-first,
(weight @ x^T)^T, and x is only a few rows — the shape of every decode step. One engine decode
step of SmolLM2 (fp32, 2 threads, bench.decode_step's batch, A/B in one process; the decoder's
linears switched, the LM head weight-first in both — alone it gave 87 -> 71 ms at batch 4):

    batch       2      4      8     16     32     48     64
    F.linear   77     71     88    121    161    209    253   ms
    weight-1st 32     43     67    101    139    184    228   ms

From ~256 rows (prefill chunks) F.linear is the faster one again, hence the cut-off. The sums
are the same; the rounding is bitwise equal to F.linear from 16 rows, and differs in the last
bit below that (as between any two GEMM kernels; one row stays F.linear).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WEIGHT_FIRST_MAX_ROWS = 128


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] -> [rows, out], like F.linear(x, weight, bias)."""
    if x.device.type != "cpu" or x.dim() != 2 or not 2 <= x.shape[0] <= WEIGHT_FIRST_MAX_ROWS:
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out.add_(bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) computed by `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
