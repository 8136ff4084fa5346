"""The Triton W8A16 kernel (kernels/triton/w8a16.py) against its PyTorch reference
(kernels.fp8.fp8_linear_torch) under the interpreter, in its own process.

    python tests/fp8_cases.py GROUP SEED        GROUP: linear | checks | all

As tests/moe_cases.py: tests/kernels/test_fp8_triton.py runs this in a subprocess and reads one
JSON line per case. Shapes are drawn from the seed: rows from 1 (decode, 16-row tiles) to past 16
(64-row tiles), N and K not multiples of the tiles; scales per row or per 32/64-column group;
with and without a bias; every e4m3 code but NaN decodes exactly.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.append(os.path.dirname(_HERE))

import torch  # noqa: E402

from inferline.kernels import fp8  # noqa: E402
from tests.kernel_cases import DTYPES, expect_assert, pick, randint, report  # noqa: E402

# fp32: summation order only; 16-bit: the output rounded to the dtype (the sum is fp32 in both)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def linear_case(gen, idx: int, dtype: torch.dtype) -> None:
    m = pick(gen, (1, 3, 16)) if idx % 2 == 0 else randint(gen, 17, 40)
    n, k = randint(gen, 20, 100), randint(gen, 20, 140)
    group_k = pick(gen, (0, 32, 64))
    groups = -(-k // group_k) if group_k else 1
    x = torch.randn(m, k, generator=gen).to(dtype)
    codes = (torch.randn(n, k, generator=gen) * 100).to(fp8.FP8)
    scale = torch.rand(n, groups, generator=gen) / 100 + 1e-3
    bias = torch.randn(n, generator=gen).to(dtype) if idx % 3 == 0 else None
    out = torch.full((m, n), float("nan"), dtype=dtype)
    out.copy_(fp8.fp8_linear(x, codes, scale, bias, group_k))
    err = rel_err(out, fp8.fp8_linear_torch(x, codes, scale, bias, group_k))
    shape = f"M={m} N={n} K={k} group_k={group_k} bias={bias is not None}"
    ok = err <= TOL[dtype] and not out.isnan().any()
    report(f"linear[{idx}] {str(dtype)[6:]} {shape}", ok, err=err, tol=TOL[dtype])


def affine_case(gen, idx: int, dtype: torch.dtype) -> None:
    """uint8 levels with a scale and an offset per 32 columns (GGUF's Q8_0, Q4_1, ... blocks)."""
    m = pick(gen, (1, 5)) if idx % 2 == 0 else randint(gen, 17, 40)
    n, k = randint(gen, 20, 100), 32 * randint(gen, 1, 4)
    x = torch.randn(m, k, generator=gen).to(dtype)
    codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // 32, generator=gen) / 100).half().float()
    offset = -128 * scale + torch.randn(n, k // 32, generator=gen).half().float() / 100
    got = fp8.fp8_linear(x, codes, scale, None, 32, offset)
    err = rel_err(got, fp8.fp8_linear_torch(x, codes, scale, None, 32, offset))
    report(f"affine[{idx}] {str(dtype)[6:]} M={m} N={n} K={k}", err <= TOL[dtype], err=err)


def checks_cases(gen) -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(fp8.FP8)
    codes = codes[~codes.float().isnan()].reshape(-1, 1).contiguous()  # 254 codes, K = 1
    got = fp8.fp8_linear(torch.ones(1, 1), codes, torch.ones(codes.shape[0], 1))
    report("every code decodes exactly", torch.equal(got[0], codes.float()[:, 0]))
    x, w, s = torch.randn(2, 64), torch.randn(8, 64).to(fp8.FP8), torch.ones(8, 1)
    expect_assert("bf16 weight", lambda: fp8.fp8_linear(x, w.bfloat16(), s))
    expect_assert("scale groups", lambda: fp8.fp8_linear(x, w, torch.ones(8, 3), group_k=32))
    expect_assert("group_k 48", lambda: fp8.fp8_linear(x, w, torch.ones(8, 2), group_k=48))
    levels = torch.zeros(8, 64, dtype=torch.uint8)
    expect_assert("uint8 without offsets", lambda: fp8.fp8_linear(x, levels, s, group_k=32))
    batched = fp8.fp8_linear(x.view(1, 2, 64), w, s)
    report("leading dims kept", batched.shape == (1, 2, 8))


def main() -> None:
    group, seed = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)  # the interpreter is Python-bound; leave the other core alone
    gen = torch.Generator().manual_seed(seed)
    if group not in ("linear", "checks", "all"):
        raise SystemExit(f"unknown group {group!r}")
    if group in ("linear", "all"):
        for i, dtype in enumerate(d for d in DTYPES for _ in range(3)):
            linear_case(gen, i, dtype)
        for i, dtype in enumerate(DTYPES):
            affine_case(gen, i, dtype)
    if group in ("checks", "all"):
        checks_cases(gen)


if __name__ == "__main__":
    main()
