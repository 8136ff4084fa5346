"""Linear layers for the engine's models: on the CPU in fp32 over a weight packed once at load,
by the project's own GEMM (kernels/cpu/gemm.py: `c`) or oneDNN (`onednn`); else F.linear (`torch`).
INFERLINE_MODEL__CPU_LINEAR chooses; `auto` is `c` where that was measured faster (AVX2 without
AVX-512: kernels/cpu/gemm.py), else `onednn`. What follows is about oneDNN.

F.linear on the CPU is MKL's sgemm, which copies ("packs") the weight into its blocked layout on
every call. For the few rows of a decode step that packing is most of the work, and MKL also
runs far below the machine's rate on AMD CPUs. oneDNN (bundled with PyTorch) can pack each
weight once, at load, and then multiply any number of rows against the packed copy. Every linear
layer of SmolLM2 (decoder only), fp32, 2 threads, GFLOP/s on an AMD Zen 4 (`python -m
bench.decode_step --compare` shows the effect on whole steps; bench/linear_backends.py compares
the three backends):

    rows                 1     8    16    29    64   256
    F.linear (MKL)      18    63   105   119   157   167
    oneDNN, prepacked   30   137   173   194   203   213

and the LM head [49152 x 576] at 29 rows: 28.5 ms -> 11.5 ms. A row's result does not depend
on the other rows (the same kernel runs every row, checked in tests/test_linear.py), so a prompt
gives the same tokens alone or in a batch; the sums differ from MKL's in the last bits, as
between any two GEMM kernels. One exception, seen on an Intel Xeon with AVX-512 (not on AMD
Zen 4): a lone row of more than 1024 inputs (SmolLM2's down projection, 1536) goes to another
kernel, whose sums differ from the same row's in any batch. So each weight shape is probed once
(`lone_row_exact`), and where a lone row's bits differ it is computed as two (itself twice):
a sequence decoding alone gets the bits it gets in a batch. Probing, not always padding: two
rows cost ~14% more than one on shapes that need no padding (SmolLM2's 30 layers at one row on
that Xeon: 29.7 ms alone, 33.9 padded everywhere, 30.5 padded where the probe says). The packed
copy (either backend's) is kept next to the weight (the weight stays the model's parameter: state
dict, tied embeddings): it doubles the linears' memory on the CPU.
"""
from __future__ import annotations

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from kernels.backends import onednn_available
from kernels.cpu import gemm

log = structlog.get_logger(__name__)
_pack_failed = False  # warned once, not once per weight
_lone_row_exact: dict[tuple[int, int, int], bool] = {}  # (out, in, threads) -> lone_row_exact's answer


# What `packed` may be: oneDNN's packed tensor, or the C GEMM's panels (fp32 or 8-bit codes).
Packed = torch.Tensor | gemm.PackedWeight | gemm.CodedWeight
BACKENDS = ("c", "onednn")


def pack_weight(weight: torch.Tensor, backend: str = "onednn", codes: bool = False) -> Packed | None:
    """The packed copy of a CPU fp32 `weight` [out, in] for `backend` (BACKENDS); None where that
    does not apply (other devices and dtypes, a PyTorch built without oneDNN). `codes`: the C GEMM
    keeps the weight as 8-bit codes where they give it back exactly (kernels/cpu/gemm.py), else fp32."""
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
    except (RuntimeError, NotImplementedError) as exc:  # a build whose oneDNN lacks the op: F.linear
        global _pack_failed
        if not _pack_failed:
            log.warning("oneDNN weight packing failed; linear layers stay on F.linear", error=str(exc)[:500])
            _pack_failed = True
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: Packed | None = None) -> torch.Tensor:
    """x [rows, in] -> [rows, out], like F.linear(x, weight, bias); on `packed` (pack_weight's
    copy of `weight`) when given."""
    if packed is None:
        return F.linear(x, weight, bias)
    if isinstance(packed, (gemm.PackedWeight, gemm.CodedWeight)):
        return gemm.gemm(x, packed, bias)
    if x.dim() == 2 and x.shape[0] == 1 and not lone_row_exact(weight, packed):
        return _onednn(x.expand(2, -1), packed, bias)[:1]  # computed as in a batch: see above
    return _onednn(x, packed, bias)


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def lone_row_exact(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether oneDNN gives a row alone the bits it gives the same row in a batch, for weights of
    this shape on this machine (and thread count: oneDNN splits work by it). Probed once with
    random rows: two kernels that add in different orders disagree somewhere in the last bits of
    hundreds of random outputs."""
    key = (*weight.shape, torch.get_num_threads())
    if key not in _lone_row_exact:
        x = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0))
        _lone_row_exact[key] = torch.equal(_onednn(x[:1], packed, None), _onednn(x, packed, None)[:1])
    return _lone_row_exact[key]


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names), computed on a packed copy of the
    weight once `pack()` made one."""

    packed: Packed | None = None

    def pack(self, backend: str = "onednn", codes: bool = False) -> bool:
        """Make the packed copy (call after the weights are final); False where none applies."""
        self.packed = pack_weight(self.weight, backend, codes)
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)
