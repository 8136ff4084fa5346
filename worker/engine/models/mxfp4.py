"""MXFP4 checkpoints (the published gpt-oss-20b and -120b: quantization_config quant_method
"mxfp4"): each expert projection is stored as `<name>_blocks` (uint8 [E, out, in / 32, 16], two
fp4 e2m1 codes a byte, the low nibble first) and `<name>_scales` (uint8 [E, out, in / 32], an
e8m0 exponent per 32 inputs, biased by 127). They are dequantized once at load, an expert at a
time, into the model's dtype: value = E2M1[code] * 2^(scale - 127), as transformers'
integrations/mxfp4.py convert_moe_packed_tensors does. design: docs/architecture.md#fp8-weights
"""

from __future__ import annotations

import torch

METHOD = "mxfp4"
# fp4 e2m1 codes 0..15: sign bit 3, then 2 exponent bits and 1 mantissa bit
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def is_mxfp4(config) -> bool:
    """Whether the config declares MXFP4 experts."""
    qc = getattr(config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    return bool(qc) and qc.get("quant_method") == METHOD


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [..., groups * 32] of uint8 blocks [..., groups, 16] and scales [..., groups]."""
    assert blocks.dtype == scales.dtype == torch.uint8, (blocks.dtype, scales.dtype)
    assert blocks.shape[:-1] == scales.shape and blocks.shape[-1] == 16, (
        blocks.shape,
        scales.shape,
    )
    table = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., groups, 16, 2]
    values = table[codes].flatten(-2)  # [..., groups, 32]: the low nibble first
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


def stored_names(name: str) -> tuple[str, str]:
    """The blocks and scales tensors that hold the weight `name`."""
    return name + "_blocks", name + "_scales"


def in_checkpoint(name: str, index: dict) -> bool:
    """Whether `name` is stored as MXFP4 blocks and scales."""
    return all(n in index for n in stored_names(name))
