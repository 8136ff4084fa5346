"""FP8 (e4m3) checkpoints: the scheme a config's `quantization_config` names, validated at load,
and each weight's scales as the kernels take them (fp32 [rows, groups]).

Two formats, as published FP8 Llama and Qwen checkpoints use them:
- `compressed-tensors` (llm-compressor; format float-quantized or naive-quantized): one config
  group of 8-bit float weights, strategy tensor (`weight_scale` [1]), channel ([N, 1]) or block
  ([N / bn, K / bk], `block_structure`);
- `fp8` (Qwen3-*-FP8, DeepSeek): `weight_block_size` [bn, bk] with `weight_scale_inv` per block
  (multiplied, despite its name), or without it one `weight_scale` per tensor.
Activation scales (dynamic, or static `input_scale`) are read by no one: the weights are
dequantized (CPU) or decoded in the kernel (W8A16), and activations stay in the model's dtype.
design: docs/architecture.md#fp8-weights
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("compressed-tensors (float-quantized, naive-quantized)", "fp8")
STRATEGIES = ("tensor", "channel", "block")


class UnsupportedQuantization(ValueError):
    """A checkpoint's quantization this loader refuses, with the scheme named."""


@dataclass(frozen=True)
class Fp8Scheme:
    method: str  # "compressed-tensors" or "fp8"
    strategy: str  # "tensor", "channel" or "block"
    block: tuple[int, int] | None  # (rows, columns) of a scale block; None unless strategy block
    scale_suffix: str  # the scale's name beside `<module>.weight`
    activations: str  # "none", "dynamic" or "static": what the checkpoint says, unused here

    def describe(self) -> str:
        block = f" {self.block[0]}x{self.block[1]}" if self.block else ""
        return f"{self.method} (float8 e4m3 weights, per-{self.strategy}{block} scales)"

    @property
    def group_k(self) -> int:
        """The kernel's scale-group width: 0 for one scale per row, else the blocks' columns."""
        return self.block[1] if self.block else 0

    def codes_fit(self) -> bool:
        """Whether the W8A16 kernel takes these scales as they are (block widths a power of two
        from 16); else the weights are dequantized at load."""
        k = self.group_k
        return k == 0 or (k >= 16 and k & (k - 1) == 0)


def quantization_dict(config) -> dict | None:
    qc = getattr(config, "quantization_config", None)
    if qc is None or isinstance(qc, dict):
        return qc
    return qc.to_dict()


def fp8_scheme(config) -> Fp8Scheme | None:
    """The config's FP8 scheme, None for an unquantized model; raises UnsupportedQuantization
    for any other quantization, naming it."""
    qc = quantization_dict(config)
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "mxfp4":  # gpt-oss's experts: dequantized at load (models/mxfp4.py), no FP8
        return None
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _fp8(qc)
    raise UnsupportedQuantization(
        f"quantization {method!r} is not supported (supported: {', '.join(FORMATS)}, "
        "mxfp4 for gpt-oss's experts)"
    )


def _compressed_tensors(qc: dict) -> Fp8Scheme:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise UnsupportedQuantization(
            f"compressed-tensors format {fmt!r} is not supported (supported: float-quantized, "
            "naive-quantized with 8-bit float weights)"
        )
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise UnsupportedQuantization(
            f"compressed-tensors with {len(groups)} config groups is not supported (one group of "
            "fp8 weights)"
        )
    group = groups[0]
    weights, acts = group.get("weights"), group.get("input_activations")
    if not weights:
        kind = _describe_args(acts) if acts else "nothing"
        raise UnsupportedQuantization(
            f"compressed-tensors scheme quantizes activations only ({kind}), not the weights: "
            "not supported (fp8 weights are)"
        )
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise UnsupportedQuantization(
            f"compressed-tensors weights {_describe_args(weights)} are not supported "
            "(8-bit float weights are)"
        )
    strategy = weights.get("strategy")
    if strategy not in STRATEGIES:
        raise UnsupportedQuantization(
            f"compressed-tensors fp8 weight strategy {strategy!r} is not supported "
            f"(supported: {', '.join(STRATEGIES)})"
        )
    block = None
    if strategy == "block":
        block = _block(weights.get("block_structure"), "compressed-tensors block_structure")
    return Fp8Scheme("compressed-tensors", strategy, block, "weight_scale", _activations(acts))


def _fp8(qc: dict) -> Fp8Scheme:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedQuantization(f"fp8 fmt {fmt!r} is not supported (e4m3 is)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise UnsupportedQuantization(f"fp8 activation_scheme {scheme!r} is not supported")
    size = qc.get("weight_block_size")
    if size is None:
        return Fp8Scheme("fp8", "tensor", None, "weight_scale", scheme)
    return Fp8Scheme("fp8", "block", _block(size, "fp8 weight_block_size"), "weight_scale_inv",
                     scheme)  # fmt: skip


def _block(size, what: str) -> tuple[int, int]:
    if not (isinstance(size, (list, tuple)) and len(size) == 2 and all(
        isinstance(v, int) and v > 0 for v in size
    )):  # fmt: skip
        raise UnsupportedQuantization(f"{what} {size!r} is not two positive integers")
    return int(size[0]), int(size[1])


def _activations(acts: dict | None) -> str:
    if not acts:
        return "none"
    return "dynamic" if acts.get("dynamic") else "static"


def _describe_args(args: dict) -> str:
    return f"{args.get('type')}{args.get('num_bits')} ({args.get('strategy')})"


def scale_rows(
    scheme: Fp8Scheme, name: str, scale: torch.Tensor, shape: tuple[int, int]
) -> torch.Tensor:
    """The checkpoint scale of the weight `name` [N, K] as fp32 [N, groups]: per tensor and per
    channel one column; per block each row takes its block row's scales. Raises
    UnsupportedQuantization for a scale of the wrong shape or value."""
    n, k = shape
    scale = scale.float()
    if scheme.strategy == "block":
        bn, bk = scheme.block
        want = (-(-n // bn), -(-k // bk))
        _check(tuple(scale.shape) == want, scheme, name, scale, f"[{want[0]}, {want[1]}]", shape)
        rows = scale.repeat_interleave(bn, dim=0)[:n]
    elif scheme.strategy == "channel":
        _check(tuple(scale.shape) in ((n,), (n, 1)), scheme, name, scale, f"[{n}, 1]", shape)
        rows = scale.reshape(n, 1)
    else:
        _check(scale.numel() == 1, scheme, name, scale, "[1]", shape)
        rows = scale.reshape(1, 1).expand(n, 1)
    if not bool(torch.isfinite(rows).all()) or bool((rows < 0).any()):
        raise UnsupportedQuantization(
            f"{name}: {scheme.describe()}: its scales hold negative, inf or NaN values"
        )
    return rows.contiguous()


def _check(ok: bool, scheme, name: str, scale, want: str, shape) -> None:
    if not ok:
        raise UnsupportedQuantization(
            f"{name}: {scheme.describe()}: scale of shape {list(scale.shape)} does not fit a "
            f"{list(shape)} weight (want {want})"
        )


def scale_name(scheme: Fp8Scheme, weight_name: str) -> str:
    """`model.layers.0.mlp.down_proj.weight` -> its scale's name in the checkpoint."""
    return weight_name.removesuffix("weight") + scheme.scale_suffix
