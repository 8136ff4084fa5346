"""Linear layers: on the CPU in fp32 over a weight packed once for the C GEMM or oneDNN, else
F.linear. design: docs/architecture.md#the-model
"""

from __future__ import annotations

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from inferline.kernels.backends import onednn_available
from inferline.kernels.cpu import gemm
from inferline.kernels.fp8 import DECODE_ROWS, FP8, fp8_linear

log = structlog.get_logger(__name__)
_pack_failed = False  # warned once, not per weight
_lone_row_exact: dict[tuple[int, int, int], bool] = {}  # (out, in, threads) -> answer


# oneDNN's packed tensor, or the C GEMM's panels (fp32 or 8-bit codes).
Packed = torch.Tensor | gemm.PackedWeight | gemm.CodedWeight
BACKENDS = ("c", "onednn")


def pack_weight(
    weight: torch.Tensor, backend: str = "onednn", codes: bool = False
) -> Packed | None:
    """The packed copy of a CPU fp32 `weight` [out, in] for `backend`, or None; `codes`: 8-bit
    codes where exact."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if backend == "c":
        if not gemm.available():
            return None
        return (codes and gemm.pack_codes(weight)) or gemm.pack(weight)
    assert backend == "onednn", f"backend must be one of {BACKENDS}, got {backend!r}"
    if not onednn_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (RuntimeError, NotImplementedError) as exc:  # oneDNN lacks the op: F.linear
        global _pack_failed
        if not _pack_failed:
            log.warning(
                "oneDNN weight packing failed; linear layers stay on F.linear", error=str(exc)[:500]
            )
            _pack_failed = True
        return None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: Packed | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias), on `packed` (pack_weight's copy of `weight`) when given."""
    if packed is None:
        return F.linear(x, weight, bias)
    if isinstance(packed, (gemm.PackedWeight, gemm.CodedWeight)):
        return gemm.gemm(x, packed, bias)
    if x.dim() == 2 and x.shape[0] == 1 and not lone_row_exact(weight, packed):
        return _onednn(x.expand(2, -1), packed, bias)[:1]  # computed as in a batch
    return _onednn(x, packed, bias)


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def lone_row_exact(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether oneDNN gives a lone row the bits it gives it in a batch, for this shape and thread
    count; probed once with random rows."""
    key = (*weight.shape, torch.get_num_threads())
    if key not in _lone_row_exact:
        x = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0))
        _lone_row_exact[key] = torch.equal(
            _onednn(x[:1], packed, None), _onednn(x, packed, None)[:1]
        )
    return _lone_row_exact[key]


class Linear(nn.Linear):
    """nn.Linear computed on a packed copy of the weight once `pack()` made one, or on FP8 codes
    once `use_fp8()` made the weight hold them."""

    packed: Packed | None = None
    group_k: int = 0  # coded weights: the scale groups' width (0: one scale per row)

    def use_fp8(self, group_k: int = 0) -> None:
        """Hold the weight as e4m3 codes beside fp32 scales [out, groups] (`weight_scale`), both
        unset, on the weight's device (meta before `to_empty`)."""
        n, k = self.weight.shape
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty(n, k, dtype=FP8, device=device), requires_grad=False)
        groups = -(-k // group_k) if group_k else 1
        self.register_buffer("weight_scale", torch.empty(n, groups, device=device))
        self.group_k = group_k

    def use_levels(self, group_k: int) -> None:
        """Hold the weight as uint8 levels with an fp32 scale and offset per `group_k` inputs
        (w = scale * level + offset: GGUF's Q8_0, Q4_1, ... blocks), unset, on the weight's
        device (meta before `to_empty`)."""
        n, k = self.weight.shape
        device = self.weight.device
        self.weight = nn.Parameter(
            torch.empty(n, k, dtype=torch.uint8, device=device), requires_grad=False
        )
        self.register_buffer("weight_scale", torch.empty(n, k // group_k, device=device))
        self.register_buffer("weight_offset", torch.empty(n, k // group_k, device=device))
        self.group_k = group_k

    def coded(self) -> bool:
        """Whether the weight holds codes (FP8 or uint8 levels) for the W8A16 kernel."""
        return self.weight.dtype in (FP8, torch.uint8)

    def pack(self, backend: str = "onednn", codes: bool = False) -> bool:
        """Make the packed copy once the weights are final; False where none applies."""
        self.packed = pack_weight(self.weight, backend, codes)
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.coded():
            return fp8_linear(
                x,
                self.weight,
                self.weight_scale,
                self.bias,
                self.group_k,
                self._buffers.get("weight_offset"),
            )
        return linear(x, self.weight, self.bias, self.packed)


def fp8_prompt_tokens(model: nn.Module) -> int:
    """A prompt length that takes the W8A16 kernel's prefill-sized plan (more rows than its
    decode tile), for the warm-up; 0 for a model with no coded linear layer."""
    coded = any(isinstance(m, Linear) and m.coded() for m in model.modules())
    return DECODE_ROWS + 1 if coded else 0
