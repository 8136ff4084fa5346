"""Linear layers for the engine's models: F.linear, except for decode-sized batches on the CPU.

MKL's sgemm streams the weights much better when the product is taken weight-first,
(weight @ x^T)^T, and x is a few rows — but only when that row count is a multiple of 8 (its
vector width; other counts fall to slow edge code). So on the CPU, 2..64 rows are multiplied
weight-first, padded with zero rows to a multiple of 8 from 8 rows up. Every linear layer of
SmolLM2 plus its LM head once, fp32, 2 threads, weights streamed from memory, ms (best of 2):

    rows           3     5     7    12    23    29    31    45    60    64    71   100
    F.linear     101    59    76    62    90    93    98   113   140   136   153   190
    weight-first  26    33    45    78   118   118   139   143   154   132   198   211
    ... padded    41    41    42    63    82    84    86   106   138   131   153   214

hence: unpadded below 8 rows, padded from 8 to 64, F.linear above (prefill chunks). The sums
are the same as F.linear's; rounding may differ in the last bit (as between any two GEMM
kernels). One row stays F.linear (a matrix-vector product either way).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WEIGHT_FIRST_MAX_ROWS = 64
PAD_ROWS_TO = 8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] -> [rows, out], like F.linear(x, weight, bias)."""
    rows = x.shape[0]
    if x.device.type != "cpu" or x.dim() != 2 or not 2 <= rows <= WEIGHT_FIRST_MAX_ROWS:
        return F.linear(x, weight, bias)
    if rows >= PAD_ROWS_TO and rows % PAD_ROWS_TO:
        x = torch.cat((x, x.new_zeros(PAD_ROWS_TO - rows % PAD_ROWS_TO, x.shape[1])))
    out = torch.mm(weight, x.t()).t()[:rows].contiguous()
    return out if bias is None else out.add_(bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) computed by `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
