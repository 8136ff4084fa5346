"""The CPU fp32 GEMM on packed weights (csrc/gemm.c): batch-invariant, optionally over exact 8-bit
codes. design: docs/architecture.md#kernels
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferline.kernels.cpu import build

_F32 = torch.float32


@dataclass(frozen=True)
class PackedWeight:
    """A weight [out, in] as the C GEMM reads it: panels [ceil(out / width), in, width], zeros past
    out_features."""

    panels: torch.Tensor
    out_features: int
    in_features: int


def available() -> bool:
    return build.available()


def preferred() -> bool:
    """Whether `auto`'s fixed rule (no calibration) prefers this GEMM over oneDNN: AVX2 without
    AVX-512."""
    flags = build.cpu_flags().split()
    return "avx2" in flags and "avx512f" not in flags and available()


def panel_width() -> int:
    return int(build.lib().gemm_panel_width())


def pack(weight: torch.Tensor) -> PackedWeight:
    """The packed copy of a CPU fp32 weight [out, in]; the weight stays the model's."""
    assert weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2, (
        weight.dtype
    )
    out_features, in_features = weight.shape
    width = panel_width()
    pad = -out_features % width
    padded = F.pad(weight.detach(), (0, 0, 0, pad)) if pad else weight.detach()
    panels = padded.reshape(-1, width, in_features).transpose(1, 2).contiguous()
    return PackedWeight(panels, out_features, in_features)


def gemm(
    x: torch.Tensor, packed: PackedWeight | CodedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., in] -> [..., out] = F.linear(x, weight, bias), fp32 CPU. Called ~120 times a decode
    step: checks are kept to attribute reads."""
    if x.dim() != 2:
        return gemm(x.reshape(-1, x.shape[-1]), packed, bias).view(
            *x.shape[:-1], packed.out_features
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, in_features = x.shape
    out = packed.out_features
    assert in_features == packed.in_features and x.dtype is _F32 and x.is_cpu, (
        x.shape,
        x.dtype,
        packed.in_features,
    )
    assert bias is None or (bias.dtype is _F32 and bias.is_contiguous() and bias.numel() == out), (
        "bias: fp32 [out]"
    )
    y = torch.empty(rows, out, dtype=_F32)
    if not rows:
        return y
    args = (
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        out,
        rows,
        out,
        in_features,
        torch.get_num_threads(),
    )
    if isinstance(packed, CodedWeight):
        err = build.call(
            "gemm_codes_f32", x.data_ptr(), x.stride(0), packed.blocks.data_ptr(), *args
        )
        if err:  # -1: no memory for a widened panel; -3: inputs not a multiple of the block
            raise RuntimeError(f"gemm_codes_f32 failed ({err})")
    else:
        build.call("gemm_f32", x.data_ptr(), x.stride(0), packed.panels.data_ptr(), *args)
    return y


# ---- weights as 8-bit codes (csrc/gemm.c, "weights stored as 8-bit codes") -----------------------


@dataclass(frozen=True)
class CodedWeight:
    """A weight [out, in] that is scale * code + offset exactly (codes 0..255, a (scale, offset) per
    output and input block), laid out as the C GEMM reads it: codes input-major, then scales and
    offsets."""

    blocks: torch.Tensor  # uint8 [panels, in / block, block * width + 8 * width]
    out_features: int
    in_features: int


def codes_block() -> int:
    return int(build.lib().gemm_codes_block())


# Each block's step between levels, per format: (max - min) / levels with an offset (Q4_1: 15,
# Q5_1: 31), max |w| / steps for symmetric ones (Q8_0: 127, Q4_0: 8, Q5_0: 16). Formats are tried
# on the blocks not fitted yet, best-fitting first.
_STEPS = (("range", 15), ("abs", 127), ("range", 31), ("abs", 8), ("abs", 16))


def exact_codes(
    weight: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(codes uint8 [out, in], scale, offset [out, in / block]) with weight == scale * codes +
    offset exactly, scales fp16 values; None where some block has no such codes. The search runs
    in C (csrc/codes.c), exact_codes_reference's result in seconds (docs/benchmarks.md)."""
    out_features, in_features = weight.shape
    if in_features % block or not weight.isfinite().all():
        return None
    w = weight.detach().reshape(-1, block).contiguous()
    low = w.amin(-1)
    todo = (w.amax(-1) != low).nonzero().squeeze(-1)[:256]
    formats = _formats_by_fit(w[todo], low[todo])
    steps = torch.stack([s for f in formats for s in _half_and_neighbours(_step(w, low, *f))], -1)
    scale, codes = torch.empty_like(low), torch.empty(w.shape, dtype=torch.uint8)
    unfitted = build.call(
        "gemm_codes_search",
        w.data_ptr(),
        low.data_ptr(),
        steps.data_ptr(),
        len(w),
        block,
        steps.shape[1],
        scale.data_ptr(),
        codes.data_ptr(),
    )
    if unfitted:
        return None
    return (
        codes.reshape(out_features, in_features),
        scale.reshape(out_features, -1),
        low.reshape(out_features, -1),
    )


def exact_codes_reference(
    weight: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """exact_codes in PyTorch, format by format: the C search's test oracle (fp16 scales: scale *
    code is exact in fp32, whatever the FMA contraction)."""
    out_features, in_features = weight.shape
    if in_features % block or not weight.isfinite().all():
        return None
    w = weight.detach().reshape(-1, block)
    low = w.amin(-1)
    scale, codes = torch.zeros_like(low), torch.zeros(w.shape, dtype=torch.uint8)
    todo = (w.amax(-1) != low).nonzero().squeeze(-1)  # constant block: scale 0, codes 0
    for kind, n in _formats_by_fit(w[todo[:256]], low[todo[:256]]):
        sub, sub_low = (w, low) if len(todo) == len(w) else (w[todo], low[todo])
        steps = _half_and_neighbours(_step(sub, sub_low, kind, n))  # fp16, rounded either way
        for i in range(len(steps)):
            ok, q = _fit(sub, sub_low, steps[i])
            scale[todo[ok]], codes[todo[ok]] = steps[i][ok], q[ok].to(torch.uint8)
            todo, sub, sub_low, steps = todo[~ok], sub[~ok], sub_low[~ok], [t[~ok] for t in steps]
    if len(todo):
        return None
    # every block was checked in _fit
    return (
        codes.reshape(out_features, in_features),
        scale.reshape(out_features, -1),
        low.reshape(out_features, -1),
    )


def _formats_by_fit(w: torch.Tensor, low: torch.Tensor) -> list[tuple[str, int]]:
    """_STEPS ordered by how many blocks each fits: most weights take one pass."""
    return sorted(
        _STEPS,
        key=lambda f: -int(_fit(w, low, _half_and_neighbours(_step(w, low, *f))[0])[0].sum()),
    )


def _step(w: torch.Tensor, low: torch.Tensor, kind: str, n: int) -> torch.Tensor:
    return ((w.amax(-1) - low) if kind == "range" else w.abs().amax(-1)) / n


def _fit(
    w: torch.Tensor, low: torch.Tensor, step: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each block is step * codes + low exactly, the codes) for blocks w [n, block]."""
    q = ((w - low[:, None]) / step[:, None]).round().clamp(0, 255)
    return (step > 0) & step.isfinite() & ((step[:, None] * q + low[:, None]) == w).all(-1), q


def _half_and_neighbours(step: torch.Tensor) -> list[torch.Tensor]:
    """step rounded to fp16, and the fp16 values just above and below (as fp32; step >= 0)."""
    bits = step.half().view(torch.int16)
    return [(bits + delta).clamp(min=0).view(torch.float16).float() for delta in (0, 1, -1)]


def pack_codes(weight: torch.Tensor, width: int | None = None) -> CodedWeight | None:
    """The coded copy of a CPU fp32 weight [out, in], or None where it has none."""
    assert weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2, (
        weight.dtype
    )
    block, width = codes_block(), width or panel_width()
    found = exact_codes(weight, block)
    if found is None:
        return None
    codes, scale, offset = found
    out_features, in_features = weight.shape
    pad = -out_features % width  # zero codes, scales, offsets: zero weights
    codes, scale, offset = (F.pad(t, (0, 0, 0, pad)) for t in (codes, scale, offset))
    blocks = in_features // block
    # [panels, width, blocks, block] -> [panels, blocks, block, width]: codes input-major
    codes = (
        codes.reshape(-1, width, blocks, block)
        .permute(0, 2, 3, 1)
        .reshape(-1, blocks, block * width)
    )
    scale, offset = (
        t.reshape(-1, width, blocks).transpose(1, 2).contiguous().view(torch.uint8)
        for t in (scale, offset)
    )
    return CodedWeight(
        torch.cat([codes, scale, offset], dim=-1).contiguous(), out_features, in_features
    )
