"""The fused Triton kernels (kernels/triton/norm.py, activation.py, rotary.py) against their
PyTorch paths (kernels/fused.py, ops="torch") under the interpreter, in their own process.

    python tests/fused_cases.py GROUP SEED        GROUP: norm | silu | rope | checks

As tests/kernel_cases.py (whose helpers this uses): an out-of-range load kills the process, so
tests/kernels/test_fused_triton.py runs this in a subprocess and reads one JSON line per case.
Rotary and the residual sum are the same products and sums as PyTorch's: equal bits in every
dtype. RMSNorm and SiLU may differ by the order of a reduction or the exp: within an ulp or two
of the dtype.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
# As a script its folder (tests/, which holds a `kernels` package) comes first on the path: drop
# it, and find `tests` after site-packages (where Hugging Face's `kernels` and inferline live).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.append(os.path.dirname(_HERE))

import torch  # noqa: E402

from inferline.kernels import fused  # noqa: E402
from tests.kernel_cases import DTYPES, bits_equal, expect_assert, pick, randint, report  # noqa: E402

# about two ulps of the dtype (fp32: reduction order and exp only)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
HEAD_DIMS = (64, 128, 256)


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float(((got - want).abs() / want.abs().clamp_min(1.0)).max()) if want.numel() else 0.0


def name_of(kind: str, idx: int, dtype: torch.dtype, **shape) -> str:
    return f"{kind}[{idx}] {str(dtype)[6:]} " + " ".join(f"{k}={v}" for k, v in shape.items())


def norm_case(gen, idx: int, dtype: torch.dtype) -> None:
    rows, cols = randint(gen, 1, 40), pick(gen, (64, 100, 576, 4096))
    wide = (torch.randn(rows, cols + 24, generator=gen) * 3).to(dtype)
    x = wide[:, 5 : 5 + cols]  # rows apart: a slice of a wider row
    w = torch.randn(cols, generator=gen).to(dtype)
    residual = torch.randn(rows, cols, generator=gen).to(dtype)
    got = fused.rms_norm(x, w, 1e-5, ops="triton")
    want = fused.rms_norm(x, w, 1e-5)
    err = max_rel(got, want)
    report(
        name_of("rms_norm", idx, dtype, rows=rows, cols=cols),
        err <= TOL[dtype],
        err=err,
        tol=TOL[dtype],
    )
    got_res, want_res = residual.clone(), residual.clone()
    got, same = fused.fused_add_rms_norm(x, got_res, w, 1e-6, ops="triton")
    want, want_res = fused.fused_add_rms_norm(x, want_res, w, 1e-6)
    err = max_rel(got, want)
    report(
        name_of("fused_add_rms_norm", idx, dtype, rows=rows, cols=cols),
        err <= TOL[dtype] and same is got_res and bits_equal(got_res, want_res),
        err=err,
        tol=TOL[dtype],
    )


def silu_case(gen, idx: int, dtype: torch.dtype) -> None:
    rows, inter = randint(gen, 1, 40), pick(gen, (40, 1536, 2100))
    x = torch.randn(rows, 2 * inter + 8, generator=gen) * 4
    x[0, :8] = torch.tensor(
        [-1000.0, -100.0, -88.0, -20.0, 0.0, 20.0, 89.0, 1000.0]
    )  # both ends of exp
    x = x.to(dtype)[:, : 2 * inter]
    got, want = fused.silu_and_mul(x, ops="triton"), fused.silu_and_mul(x)
    err = max_rel(got, want)
    report(
        name_of("silu_and_mul", idx, dtype, rows=rows, inter=inter),
        err <= TOL[dtype] and not got.isnan().any(),
        err=err,
        tol=TOL[dtype],
    )


def rope_inputs(gen, dtype, tokens, heads, kv_heads, head_dim, block_size=16, num_blocks=6):
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 6.28
    cos = (
        torch.cat((angles.cos(), angles.cos()), -1).unsqueeze(1).to(dtype)
    )  # as models/llama.py holds them
    sin = torch.cat((-angles.sin(), angles.sin()), -1).unsqueeze(1).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::5] = -1  # not stored (padding rows)
    cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    return qkv, cos, sin, slots, cache


def rope_case(gen, idx: int, dtype: torch.dtype, head_dim: int) -> None:
    kv_heads = pick(gen, (1, 2, 3))
    heads, tokens, block_size = (
        kv_heads * pick(gen, (1, 3, 4, 8)),
        randint(gen, 1, 40),
        pick(gen, (8, 16, 32)),
    )
    qkv, cos, sin, slots, cache = rope_inputs(
        gen, dtype, tokens, heads, kv_heads, head_dim, block_size
    )
    k_want, v_want, k_got, v_got = (cache.clone() for _ in range(4))
    want = fused.rope_store_kv(qkv.clone(), heads, kv_heads, cos, sin, k_want, v_want, slots)
    got_qkv = qkv.clone()
    got = fused.rope_store_kv(got_qkv, heads, kv_heads, cos, sin, k_got, v_got, slots, ops="triton")
    same = (
        bits_equal(got.contiguous(), want.contiguous())
        and got.data_ptr() == got_qkv.data_ptr()
        and torch.equal(got_qkv[:, heads * head_dim :], qkv[:, heads * head_dim :])
    )  # k, v rows untouched
    for g, w in ((k_got, k_want), (v_got, v_want)):
        same = (
            same
            and torch.equal(g.isnan(), w.isnan())
            and bits_equal(g.nan_to_num(), w.nan_to_num())
        )
    report(
        name_of(
            "rope_store_kv",
            idx,
            dtype,
            d=head_dim,
            heads=heads,
            kvh=kv_heads,
            tokens=tokens,
            bs=block_size,
        ),
        same,
    )


def checks_cases(gen) -> None:
    """The launchers refuse bad inputs before launching."""
    qkv, cos, sin, slots, cache = rope_inputs(gen, torch.float32, 6, 4, 2, 64)
    far = torch.tensor([0, 1, 2, 3, 4, cache.shape[0] * cache.shape[1]])
    expect_assert(
        "checks: rope slot out of range",
        lambda: fused.rope_store_kv(qkv, 4, 2, cos, sin, cache, cache.clone(), far, ops="triton"),
    )
    expect_assert(
        "checks: rope cache dtype",
        lambda: fused.rope_store_kv(
            qkv, 4, 2, cos, sin, cache.half(), cache.half(), slots, ops="triton"
        ),
    )
    x = torch.randn(3, 64)
    expect_assert(
        "checks: norm weight dtype",
        lambda: fused.rms_norm(x, torch.ones(64).half(), 1e-5, ops="triton"),
    )
    expect_assert(
        "checks: norm columns strided",
        lambda: fused.rms_norm(x[:, ::2], torch.ones(32), 1e-5, ops="triton"),
    )
    expect_assert(
        "checks: silu odd width", lambda: fused.silu_and_mul(torch.randn(3, 63), ops="triton")
    )
    empty = fused.rms_norm(torch.empty(0, 64), torch.ones(64), 1e-5, ops="triton")
    report("checks: no rows", empty.shape == (0, 64))


def main() -> None:
    group, seed = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)  # the interpreter is Python-bound; leave the other core alone
    gen = torch.Generator().manual_seed(seed)
    cases = [(i, dtype) for i, dtype in enumerate(d for d in DTYPES for _ in range(2))]
    if group == "norm":
        for i, dtype in cases:
            norm_case(gen, i, dtype)
    elif group == "silu":
        for i, dtype in cases:
            silu_case(gen, i, dtype)
    elif group == "rope":
        for i, (dtype, head_dim) in enumerate((d, h) for d in DTYPES for h in HEAD_DIMS):
            rope_case(gen, i, dtype, head_dim)
    elif group == "checks":
        checks_cases(gen)
    else:
        raise SystemExit(f"unknown group {group!r}")


if __name__ == "__main__":
    main()
