"""kernels/cpu/gemm.py (csrc/gemm.c): the linear layers' C GEMM equals F.linear on random shapes,
and a row's bits depend neither on the batch around it nor on the thread count."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from inferline.kernels import backends
from inferline.kernels.cpu import build, gemm
from inferline.worker.engine.models import linear as linear_module

pytestmark = pytest.mark.skipif(
    not build.available(), reason="the CPU kernels did not build (no C compiler?)"
)
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "out_features, in_features", [(1, 1), (15, 5), (16, 96), (17, 96), (200, 577), (1000, 64)]
)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_equals_f_linear(out_features, in_features, rows, bias):
    """Widths that are and are not multiples of the panel, row counts around the tile (6 or 8)
    and past a pass's row block (300 rows of 577 inputs: 4 passes)."""
    gen = torch.Generator().manual_seed(out_features * 1000 + rows)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    out, ref = gemm.gemm(x, gemm.pack(w), b), F.linear(x, w, b)
    assert out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * in_features**0.5)


def test_a_row_gets_the_same_bits_in_any_batch_and_with_any_thread_count():
    """Every output is one FMA chain over the inputs in order: the same bits alone, at any
    position of any batch, with one thread or two (what batch invariance of the engine needs)."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(70, 1536, generator=gen), torch.randn(600, 1536, generator=gen)
    assert_row_bits_invariant(x, gemm.pack(w))


def assert_row_bits_invariant(x: torch.Tensor, packed) -> None:
    """gemm(x, packed)'s rows are the same bits in slices of x and with 1 or 3 threads."""
    full = gemm.gemm(x, packed)
    for start, rows in ((0, 1), (0, 5), (3, 7), (11, 13), (40, 30)):
        assert torch.equal(
            gemm.gemm(x[start : start + rows], packed), full[start : start + rows]
        ), (start, rows)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(gemm.gemm(x, packed), full), n
    finally:
        torch.set_num_threads(threads)


def test_gemm_takes_strided_views_and_leading_dims():
    w, b = torch.randn(40, 48), torch.randn(40)
    packed = gemm.pack(w)
    rows_apart = torch.randn(10, 2, 48)[:, 0]  # rows 96 floats apart, as a slice of a wider tensor
    torch.testing.assert_close(
        gemm.gemm(rows_apart, packed, b), F.linear(rows_apart, w, b), rtol=1e-5, atol=1e-5
    )
    cols_apart = torch.randn(48, 10).t()  # not packed along a row: copied first
    torch.testing.assert_close(
        gemm.gemm(cols_apart, packed), F.linear(cols_apart, w), rtol=1e-5, atol=1e-5
    )
    batch = torch.randn(3, 4, 48)
    torch.testing.assert_close(gemm.gemm(batch, packed), F.linear(batch, w), rtol=1e-5, atol=1e-5)
    assert gemm.gemm(torch.empty(0, 48), packed).shape == (0, 40)


def test_the_pack_is_panels_of_output_columns_zero_padded():
    width = gemm.panel_width()
    assert width in (
        16,
        32,
    )  # two vectors of the build's width: AVX2 8 floats, AVX-512 (or none) 16
    w = torch.randn(width + 3, 5)
    panels = gemm.pack(w).panels
    assert panels.shape == (2, 5, width)
    assert torch.equal(panels[0], w[:width].t()) and torch.equal(panels[1, :, :3], w[width:].t())
    assert not panels[1, :, 3:].any()


def test_wrong_inputs_are_refused():
    packed = gemm.pack(torch.randn(8, 4))
    with pytest.raises(AssertionError):
        gemm.gemm(torch.randn(2, 5), packed)  # 5 inputs for a weight of 4
    with pytest.raises(AssertionError):
        gemm.gemm(torch.randn(2, 4, dtype=torch.float64), packed)
    with pytest.raises(AssertionError):
        gemm.pack(torch.randn(8, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "flags, preferred",
    [
        ("flags : fpu sse2 avx avx2 fma", True),
        ("flags : fpu sse2 avx avx2 fma avx512f avx512bw", False),
        ("Features : fp asimd", False),
    ],
)
def test_auto_picks_the_c_gemm_only_where_it_was_measured_faster(monkeypatch, flags, preferred):
    monkeypatch.setattr(build, "cpu_flags", lambda: flags)
    assert gemm.preferred() == preferred
    expected = "c" if preferred else ("onednn" if backends.onednn_available() else "torch")
    assert backends.select_linear(CPU, torch.float32, "auto") == expected


def test_an_explicit_backend_the_machine_cannot_run_stops_at_load(monkeypatch):
    assert backends.select_linear(CPU, torch.float32, "c") == "c"
    assert backends.select_linear(CPU, torch.float32, "torch") == "torch"
    monkeypatch.setattr(gemm, "available", lambda: False)
    with pytest.raises(
        backends.BackendUnavailable, match="cpu_linear=c but the C kernels did not build"
    ):
        backends.select_linear(CPU, torch.float32, "c")
    assert backends.select_linear(CPU, torch.float32, "auto") in ("onednn", "torch")
    assert linear_module.pack_weight(torch.randn(4, 8), "c") is None


def test_linear_dispatches_on_the_packed_copy():
    w, b, x = torch.randn(24, 16), torch.randn(24), torch.randn(3, 16)
    module = linear_module.Linear(16, 24)
    with torch.no_grad():
        module.weight.copy_(w)
        module.bias.copy_(b)
    assert module.pack("c") and isinstance(module.packed, gemm.PackedWeight)
    with torch.no_grad():
        assert torch.equal(module(x), gemm.gemm(x, module.packed, b))
    torch.testing.assert_close(module(x).detach(), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not shutil.which("cc"),
    reason="builds gemm.c for another x86 target with the system compiler",
)
def test_the_16_float_layout_equals_f_linear_too(tmp_path):
    """The library's own build has 8-float vectors on AVX2 (tiles of 6 x 16) and 16-float ones
    with AVX-512 or without AVX2 (tiles of 8 x 32): CI's machine runs one. This builds gemm.c for
    plain x86-64 (no AVX2: the same C path as AVX-512, in SSE registers) and checks it runs
    right."""
    lib = build_x86_64(tmp_path)
    width = lib.gemm_panel_width()
    assert width == 32
    gen = torch.Generator().manual_seed(1)
    for out_features, in_features in ((32, 40), (70, 577)):
        w = torch.randn(out_features, in_features, generator=gen)
        b = torch.randn(out_features, generator=gen)
        panels = (
            F.pad(w, (0, 0, 0, -out_features % width))
            .view(-1, width, in_features)
            .transpose(1, 2)
            .contiguous()
        )
        x = torch.randn(19, in_features, generator=gen)  # tiles of 8, 8 and 3 rows
        outs = []
        for rows in (19, 1, 8):
            y = torch.empty(rows, out_features)
            lib.gemm_f32(
                x.data_ptr(),
                in_features,
                panels.data_ptr(),
                b.data_ptr(),
                y.data_ptr(),
                out_features,
                rows,
                out_features,
                in_features,
                2,
            )
            outs.append(y)
        torch.testing.assert_close(outs[0], F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        assert torch.equal(outs[1], outs[0][:1]) and torch.equal(outs[2], outs[0][:8])


def build_x86_64(tmp_path, march: str = "x86-64") -> ctypes.CDLL:
    """gemm.c built for `march` (default plain x86-64: 16-float vectors in SSE registers), its
    functions typed."""
    flags = [f if f != "-march=native" else f"-march={march}" for f in build.FLAGS]
    lib_path = tmp_path / f"gemm_{march}.so"
    done = subprocess.run(
        [
            "cc",
            *flags,
            "-shared",
            "-I",
            str(build.CSRC),
            str(build.CSRC / "gemm.c"),
            "-o",
            str(lib_path),
        ],
        capture_output=True,
        text=True,
        timeout=build.BUILD_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lib = ctypes.CDLL(str(lib_path))
    for name in ("gemm_panel_width", "gemm_f32", "gemm_codes_block", "gemm_codes_f32"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = build._FUNCTIONS[name]
    return lib


# The SIMD builds `-march=native` gives on x86 (AVX2 + FMA: 8-float vectors, tiles of 6 x 16;
# AVX-512: 16-float vectors, tiles of 8 x 32), each built explicitly so that a machine with
# AVX-512 tests its AVX2 build too; the CPU flags each needs to run.
SIMD_BUILDS = {
    "x86-64-v3": (16, ("avx2", "fma", "f16c")),
    "x86-64-v4": (32, ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd")),
}


def runs_here(march: str) -> bool:
    have = build.cpu_flags().split()
    return (
        platform.machine() in ("x86_64", "AMD64")
        and bool(shutil.which("cc"))
        and all(f in have for f in SIMD_BUILDS[march][1])
    )


def lib_gemm(lib, x, panels, bias, out_features, threads=2, codes=False) -> torch.Tensor:
    rows, in_features = x.shape
    y = torch.empty(rows, out_features)
    fn = lib.gemm_codes_f32 if codes else lib.gemm_f32
    err = fn(
        x.data_ptr(),
        in_features,
        panels.data_ptr(),
        bias.data_ptr(),
        y.data_ptr(),
        out_features,
        rows,
        out_features,
        in_features,
        threads,
    )
    assert not err
    return y


def simd_case(width: int, out_features: int, in_features: int, seed: int):
    """A Q8_0-like weight (exact 8-bit codes), its fp32 panels and codes for `width`, bias, rows."""
    from tests.kernels.test_gemm_codes import q8_0, weight

    gen = torch.Generator().manual_seed(seed)
    w = weight(out_features, in_features, q8_0, seed=seed)
    panels = (
        F.pad(w, (0, 0, 0, -out_features % width))
        .view(-1, width, in_features)
        .transpose(1, 2)
        .contiguous()
    )
    return (
        w,
        panels,
        gemm.pack_codes(w, width=width).blocks,
        torch.randn(out_features, generator=gen),
        torch.randn(45, in_features, generator=gen),
    )


@pytest.mark.parametrize("march", list(SIMD_BUILDS))
def test_each_simd_build_gives_a_row_the_same_bits_in_any_batch_and_thread_count(tmp_path, march):
    """The AVX2 and the AVX-512 build of gemm.c, on whichever this machine can run: equal to
    F.linear; a row's bits the same alone, in any slice of the batch and with 1-3 threads; codes
    widened to the bits of the fp32 panels."""
    if not runs_here(march):
        pytest.skip(f"this CPU cannot run a {march} build")
    lib = build_x86_64(tmp_path, march)
    width = SIMD_BUILDS[march][0]
    assert lib.gemm_panel_width() == width
    for out_features, in_features in ((33, 64), (200, 576), (70, 1536)):
        w, panels, codes, b, x = simd_case(width, out_features, in_features, seed=out_features)
        full = lib_gemm(lib, x, panels, b, out_features)
        torch.testing.assert_close(full, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        for start, rows in ((0, 1), (0, 5), (3, 7), (11, 13), (40, 5), (7, 1)):
            part = lib_gemm(lib, x[start : start + rows].contiguous(), panels, b, out_features)
            assert torch.equal(part, full[start : start + rows]), (march, out_features, start, rows)
        for threads in (1, 3):
            assert torch.equal(lib_gemm(lib, x, panels, b, out_features, threads), full), (
                march,
                threads,
            )
        assert torch.equal(lib_gemm(lib, x, codes, b, out_features, codes=True), full), (
            march,
            "codes",
        )


def test_the_avx2_and_avx512_builds_give_the_same_bits(tmp_path):
    """Each output is one FMA chain over the inputs in order in both builds: a model's tokens do
    not depend on which of the two a machine runs (where both run here)."""
    if not (runs_here("x86-64-v3") and runs_here("x86-64-v4")):
        pytest.skip("needs a CPU with AVX-512")
    outs = {}
    for march, (width, _flags) in SIMD_BUILDS.items():
        lib = build_x86_64(tmp_path, march)
        w, panels, _codes, b, x = simd_case(width, 200, 576, seed=5)
        outs[march] = lib_gemm(lib, x, panels, b, 200)
    assert torch.equal(outs["x86-64-v3"], outs["x86-64-v4"])
