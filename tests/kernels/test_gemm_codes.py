"""kernels/cpu/gemm.py's 8-bit codes (csrc/gemm.c): the codes are found exactly where a weight was
quantized (GGUF's Q4_1, Q8_0, ...), never where it was not, and the GEMM over them gives the same
bits as over the fp32 panels, in any batch and with any thread count."""

from __future__ import annotations

import pytest
import torch

from inferline.kernels.cpu import build, gemm
from tests.kernels.test_gemm import assert_row_bits_invariant, build_x86_64
from inferline.worker.engine.models import linear as linear_module

pytestmark = pytest.mark.skipif(
    not build.available(), reason="the CPU kernels did not build (no C compiler?)"
)

BLOCK = 32


# Each dequantized as ggml does it: fp16 scale (and min) widened, times the code (plus the min).
def q_min_max(x: torch.Tensor, levels: int) -> torch.Tensor:
    """ggml's quantize_row_q4_1_ref (levels 15) or q5_1's (31), then dequantize: codes 0..levels
    from each block's min to its max."""
    b = x.reshape(-1, BLOCK)
    low, high = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d = (high - low) / levels
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = ((b - low) * inv + 0.5).trunc().clamp(0, levels)
    return (d.half().float() * q + low.half().float()).reshape(x.shape)


def q4_1(x: torch.Tensor) -> torch.Tensor:
    return q_min_max(x, 15)


def q5_1(x: torch.Tensor) -> torch.Tensor:
    return q_min_max(x, 31)


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q8_0_ref: codes -127..127 of max |x| / 127."""
    b = x.reshape(-1, BLOCK)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (d.half().float() * (b * inv).round()).reshape(x.shape)


def q4_0(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q4_0_ref: d = the value of largest magnitude / -8, codes 0..15 around 8."""
    b = x.reshape(-1, BLOCK)
    top = b.gather(-1, b.abs().argmax(-1, keepdim=True))
    d = top / -8
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = (b * inv + 8.5).trunc().clamp(max=15)
    return (d.half().float() * (q - 8)).reshape(x.shape)


QUANTIZERS = [q4_1, q5_1, q8_0, q4_0]


def weight(out_features: int, in_features: int, quantize, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(out_features, in_features, generator=gen) * 0.05)


@pytest.mark.parametrize("quantize", QUANTIZERS)
def test_codes_are_found_for_every_ggml_format_and_give_the_weight_back(quantize):
    w = weight(70, 256, quantize)
    codes, scale, offset = gemm.exact_codes(w, BLOCK)
    assert (
        codes.dtype == torch.uint8
        and codes.shape == w.shape
        and scale.shape == offset.shape == (70, 8)
    )
    assert torch.equal(scale.half().float(), scale), (
        "scales are fp16 values: scale * code is exact in fp32"
    )
    widened = scale.repeat_interleave(BLOCK, -1) * codes.float() + offset.repeat_interleave(
        BLOCK, -1
    )
    assert torch.equal(widened, w)


def test_weights_that_were_not_quantized_have_no_codes():
    """One value off in one block, random values, a width not a multiple of the block, a NaN."""
    assert gemm.exact_codes(torch.randn(64, 64), BLOCK) is None
    w = weight(64, 64, q4_1)
    w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(1.0))
    assert gemm.exact_codes(w, BLOCK) is None
    assert gemm.exact_codes(weight(64, 64, q4_1)[:, :48], BLOCK) is None
    w = weight(64, 64, q8_0)
    w[0, 0] = float("nan")
    assert gemm.exact_codes(w, BLOCK) is None
    assert gemm.pack_codes(torch.randn(64, 64)) is None


def test_constant_and_zero_blocks_get_code_zero():
    w = torch.zeros(16, 64)
    w[1] = 0.5
    codes, scale, offset = gemm.exact_codes(w, BLOCK)
    assert not codes.any() and not scale.any() and torch.equal(offset[:, 0], w[:, 0])


def mixed_weight(seed: int) -> torch.Tensor:
    """Blocks of every format, constant blocks and, where seed is odd, one block never quantized."""
    gen = torch.Generator().manual_seed(seed)
    rows = [q(torch.randn(8, 96, generator=gen) * 0.05) for q in QUANTIZERS]
    w = torch.cat(rows + [torch.full((2, 96), 0.25)]).reshape(-1, BLOCK)
    w = w[torch.randperm(len(w), generator=gen)].reshape(-1, 96)
    if seed % 2:
        w[int(torch.randint(len(w), (1,), generator=gen)), :BLOCK] = torch.randn(
            BLOCK, generator=gen
        )
    return w


@pytest.mark.parametrize("seed", range(6))
def test_the_c_search_gives_the_reference_codes(seed):
    """exact_codes (the C search over candidate steps) equals exact_codes_reference (PyTorch, format
    by format) bit for bit, on blocks of mixed formats, constant blocks and a block never
    quantized."""
    for w in (mixed_weight(seed), weight(48, 128, QUANTIZERS[seed % 4], seed)):
        found, expected = gemm.exact_codes(w, BLOCK), gemm.exact_codes_reference(w, BLOCK)
        assert (found is None) == (expected is None)
        if expected is not None:
            for a, b in zip(found, expected):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_the_codes_are_packed_per_panel_and_block_as_the_c_gemm_reads_them():
    """Per panel of `width` outputs and block of 32 inputs: the codes input-major, then the
    scales, then the offsets (fp32); outputs past the last are zeros."""
    width = gemm.panel_width()
    w = weight(width + 3, 64, q4_1)
    codes, scale, offset = gemm.exact_codes(w, BLOCK)
    packed = gemm.pack_codes(w)
    assert (
        packed.blocks.shape == (2, 2, BLOCK * width + 8 * width)
        and packed.blocks.dtype == torch.uint8
    )
    first = packed.blocks[0, 1]  # panel 0, inputs 32..63
    assert torch.equal(first[: BLOCK * width].view(BLOCK, width), codes[:width, BLOCK:].t())
    scales = first[BLOCK * width :].view(torch.float32)
    assert torch.equal(scales[:width], scale[:width, 1]) and torch.equal(
        scales[width:], offset[:width, 1]
    )
    last = packed.blocks[1, 0]
    assert not last[: BLOCK * width].view(BLOCK, width)[:, 3:].any()


@pytest.mark.parametrize("quantize", [q4_1, q8_0])
@pytest.mark.parametrize("out_features, in_features", [(16, 32), (17, 64), (200, 576), (600, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_over_codes_gives_the_bits_of_the_fp32_panels(
    quantize, out_features, in_features, rows, bias
):
    """Widths that are and are not multiples of the panel, row counts around the tile, past a
    pass's row block (300 rows of 576 or 1536 inputs)."""
    gen = torch.Generator().manual_seed(rows)
    w = weight(out_features, in_features, quantize, seed=out_features)
    x = torch.randn(rows, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    coded = gemm.pack_codes(w)
    assert isinstance(coded, gemm.CodedWeight)
    out = gemm.gemm(x, coded, b)
    assert out.shape == (rows, out_features) and torch.equal(out, gemm.gemm(x, gemm.pack(w), b))


def test_a_row_gets_the_same_bits_in_any_batch_and_with_any_thread_count():
    x = torch.randn(70, 1536, generator=torch.Generator().manual_seed(0))
    assert_row_bits_invariant(x, gemm.pack_codes(weight(600, 1536, q4_1)))


def test_pack_weight_keeps_codes_only_where_asked_and_exact():
    quantized, plain = weight(48, 64, q8_0), torch.randn(48, 64)
    assert isinstance(linear_module.pack_weight(quantized, "c", codes=True), gemm.CodedWeight)
    assert isinstance(linear_module.pack_weight(quantized, "c"), gemm.PackedWeight)
    assert isinstance(linear_module.pack_weight(plain, "c", codes=True), gemm.PackedWeight)
    x = torch.randn(5, 64)
    layer = linear_module.Linear(64, 48)
    with torch.no_grad():
        layer.weight.copy_(quantized)
    expected = layer(x)
    assert layer.pack("c", codes=True) and isinstance(layer.packed, gemm.CodedWeight)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_the_16_float_layout_widens_codes_to_the_same_bits_too(tmp_path):
    """gemm.c for plain x86-64 (the AVX-512 builds' 16-float layout; codes widened by its plain C
    loop instead of AVX2's byte loads): over codes, the bits of its own fp32 panels."""
    lib = build_x86_64(tmp_path)
    width = lib.gemm_panel_width()
    assert width == 32 and lib.gemm_codes_block() == BLOCK
    gen = torch.Generator().manual_seed(2)
    for out_features, in_features, quantize in ((32, 64, q4_1), (70, 576, q8_0)):
        w = weight(out_features, in_features, quantize, seed=out_features)
        b = torch.randn(out_features, generator=gen)
        padded = torch.nn.functional.pad(w, (0, 0, 0, -out_features % width))
        panels = padded.view(-1, width, in_features).transpose(1, 2).contiguous()
        coded = gemm.pack_codes(w, width=width)
        assert coded.blocks.shape[-1] == BLOCK * width + 8 * width
        for rows in (19, 1):  # tiles of 8, 8 and 3 rows (widened into the buffer); one row
            x = torch.randn(rows, in_features, generator=gen)
            y_panels, y_codes = torch.empty(rows, out_features), torch.empty(rows, out_features)
            lib.gemm_f32(
                x.data_ptr(),
                in_features,
                panels.data_ptr(),
                b.data_ptr(),
                y_panels.data_ptr(),
                out_features,
                rows,
                out_features,
                in_features,
                2,
            )
            assert (
                lib.gemm_codes_f32(
                    x.data_ptr(),
                    in_features,
                    coded.blocks.data_ptr(),
                    b.data_ptr(),
                    y_codes.data_ptr(),
                    out_features,
                    rows,
                    out_features,
                    in_features,
                    2,
                )
                == 0
            )
            torch.testing.assert_close(
                y_panels, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4
            )
            assert torch.equal(y_codes, y_panels), (out_features, rows)


def test_the_c_entry_point_refuses_inputs_not_a_multiple_of_the_block():
    x, y = torch.randn(2, 48), torch.empty(2, 16)
    codes = torch.zeros(1, 2, BLOCK * 16 + 8 * 16, dtype=torch.uint8)
    assert (
        build.lib().gemm_codes_f32(
            x.data_ptr(), 48, codes.data_ptr(), None, y.data_ptr(), 16, 2, 16, 48, 1
        )
        == -3
    )
