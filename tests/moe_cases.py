"""The Triton fused-MoE kernel (kernels/triton/moe.py) against its PyTorch reference
(kernels.moe.fused_experts_torch) under the interpreter, in its own process.

    python tests/moe_cases.py GROUP SEED        GROUP: experts | fp8 | gpt_oss | checks

As tests/fused_cases.py: tests/kernels/test_fused_moe_triton.py runs this in a subprocess and
reads one JSON line per case. Shapes are tiny (the interpreter runs each program in Python) and
drawn from the seed: tokens from 1 (decode, 16-row blocks) to past 2 * experts (64-row blocks),
experts with no token, K and N not multiples of the tiles.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.append(os.path.dirname(_HERE))

import torch  # noqa: E402

from inferline.kernels import moe  # noqa: E402
from tests.kernel_cases import DTYPES, expect_assert, pick, randint, report  # noqa: E402

# fp32: summation order only; 16-bit: the intermediate is rounded to the dtype between the GEMMs
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def experts_case(gen, idx: int, dtype: torch.dtype) -> None:
    num_experts, top_k = pick(gen, ((4, 2), (8, 2), (6, 3)))
    # even cases decode-sized (16-row blocks), odd ones past 2 * experts slots (64-row blocks)
    tokens = pick(gen, (1, 3)) if idx % 2 == 0 else randint(gen, 2 * num_experts + 1, 40)
    hidden, inter = pick(gen, (32, 48, 64)), pick(gen, (16, 40, 64))
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=gen)
    logits[:, -1] -= 100.0  # the last expert gets no token: an empty run in the sorted order
    weights, ids = moe.select_experts(logits, top_k, pick(gen, moe.SCORINGS), True)
    got = moe.fused_experts(x, w13, w2, weights, ids, ops="triton")
    want = moe.fused_experts_torch(x, w13, w2, weights, ids)
    err = rel_err(got, want)
    shape = f"T={tokens} E={num_experts} k={top_k} H={hidden} I={inter}"
    report(f"experts[{idx}] {str(dtype)[6:]} {shape}", err <= TOL[dtype], err=err, tol=TOL[dtype])


def fp8_codes(w: torch.Tensor, group_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts' weights [E, N, K] as e4m3 codes and fp32 scales [E, N, groups] (a scale per row,
    or per row and group_k columns), as an FP8 checkpoint's experts load."""
    e, n, k = w.shape
    width = group_k or k
    groups = -(-k // width)
    padded = torch.zeros(e, n, groups * width)
    padded[..., :k] = w
    amax = padded.abs().view(e, n, groups, width).amax(-1).clamp_min(1e-12)
    scale = amax / 448.0
    codes = (w / scale.repeat_interleave(width, -1)[..., :k]).to(torch.float8_e4m3fn)
    return codes, scale.contiguous()


def fp8_case(gen, idx: int, dtype: torch.dtype, group_k: int) -> None:
    """The W8A16 variant on e4m3 experts against the reference on the dequantized experts."""
    num_experts, top_k = pick(gen, ((4, 2), (6, 3)))
    tokens = pick(gen, (1, 3)) if idx % 2 == 0 else randint(gen, 2 * num_experts + 1, 40)
    hidden, inter = pick(gen, (32, 48, 64)), pick(gen, (16, 40, 64))
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    c13, s13 = fp8_codes(torch.randn(num_experts, 2 * inter, hidden, generator=gen), group_k)
    c2, s2 = fp8_codes(torch.randn(num_experts, hidden, inter, generator=gen), group_k)
    logits = torch.randn(tokens, num_experts, generator=gen)
    logits[:, -1] -= 100.0
    weights, ids = moe.select_experts(logits, top_k, pick(gen, moe.SCORINGS), True)
    got = moe.fused_experts(x, c13, c2, weights, ids, "triton", s13, s2, group_k)
    w13 = moe.dequantize_experts(c13, s13, group_k)
    w2 = moe.dequantize_experts(c2, s2, group_k)
    want = moe.fused_experts_torch(x, w13, w2, weights, ids)
    err = rel_err(got, want)
    shape = f"T={tokens} E={num_experts} k={top_k} H={hidden} I={inter} group_k={group_k}"
    report(f"fp8[{idx}] {str(dtype)[6:]} {shape}", err <= TOL[dtype], err=err, tol=TOL[dtype])


def gpt_oss_case(gen, idx: int, dtype: torch.dtype) -> None:
    """gpt-oss's variant: both projections with biases (HAS_BIAS) around the clamped SwiGLU,
    inputs large enough that both clamps bite, top-k then softmax routing."""
    num_experts, top_k = pick(gen, ((4, 2), (8, 2), (6, 3)))
    tokens = pick(gen, (1, 3)) if idx % 2 == 0 else randint(gen, 2 * num_experts + 1, 40)
    hidden, inter = pick(gen, (32, 48, 64)), pick(gen, (16, 40, 64))
    x = (torch.randn(tokens, hidden, generator=gen) * 2).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    b13 = torch.randn(num_experts, 2 * inter, generator=gen).to(dtype)
    b2 = torch.randn(num_experts, hidden, generator=gen).to(dtype)
    swiglu = (1.702, 1.5)
    logits = torch.randn(tokens, num_experts, generator=gen)
    logits[:, -1] -= 100.0
    weights, ids = moe.select_experts(logits, top_k, moe.TOPK_SOFTMAX)
    got = moe.fused_experts(x, w13, w2, weights, ids, "triton", b13=b13, b2=b2, swiglu=swiglu)
    want = moe.fused_experts_torch(x, w13, w2, weights, ids, b13, b2, swiglu)
    err = rel_err(got, want)
    shape = f"T={tokens} E={num_experts} k={top_k} H={hidden} I={inter}"
    report(f"gpt_oss[{idx}] {str(dtype)[6:]} {shape}", err <= TOL[dtype], err=err, tol=TOL[dtype])


def checks_cases(gen) -> None:
    x, w13, w2 = torch.randn(3, 32), torch.randn(4, 32, 32), torch.randn(4, 32, 16)
    weights, ids = moe.select_experts(torch.randn(3, 4), 2, moe.SOFTMAX_TOPK)
    wrong = w2.transpose(1, 2).contiguous()  # [E, I, H]: down_proj's weight the wrong way round
    expect_assert("w2 [E, I, H]", lambda: moe.fused_experts(x, w13, wrong, weights, ids, "triton"))
    half = w13.half()
    expect_assert("mixed dtypes", lambda: moe.fused_experts(x, half, w2, weights, ids, "triton"))
    empty = moe.fused_experts(x[:0], w13, w2, weights[:0], ids[:0], ops="triton")
    report("no tokens", empty.shape == (0, 32))


def main() -> None:
    group, seed = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)  # the interpreter is Python-bound; leave the other core alone
    gen = torch.Generator().manual_seed(seed)
    if group == "experts":
        for i, dtype in enumerate(d for d in DTYPES for _ in range(2)):
            experts_case(gen, i, dtype)
    elif group == "fp8":  # a scale per row, per 16 and per 32 columns, both block sizes
        for i, (dtype, group_k) in enumerate((d, g) for d in DTYPES for g in (0, 16, 32)):
            fp8_case(gen, i, dtype, group_k)
    elif group == "gpt_oss":
        for i, dtype in enumerate(d for d in DTYPES for _ in range(2)):
            gpt_oss_case(gen, i, dtype)
    elif group == "checks":
        checks_cases(gen)
    else:
        raise SystemExit(f"unknown group {group!r}")


if __name__ == "__main__":
    main()
