"""`make gpu-compile` on a few plans (no GPU needed): the launch plans at head_dim 128 in bf16
(attention, rotary with the K/V store; RMSNorm and SiLU-and-mul at Llama-3-8B's sizes; the fused
MoE's grouped GEMMs at Mixtral-8x7B's, decode- and prefill-sized; the FP8 W8A16 linear with block
scales and a bias, prefill-sized, and per-row scales, decode-sized) compile
for sm_90a without spills and within shared memory, and the check does catch a plan
that is too large. The whole matrix is `make gpu-compile` (minutes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from scripts import gpu_compile as cc
from inferline.kernels.triton.decode import plan_decode

ARCH = 90


@pytest.fixture(scope="module")
def rows() -> dict[str, cc.Row]:
    decode = list(cc.decode_jobs(128, 4, 16, torch.bfloat16, ARCH))
    picks = {
        "direct": next(j for j in decode if dict(j.constexprs).get("DIRECT") is True),
        "split": next(j for j in decode if dict(j.constexprs).get("DIRECT") is False),
        "stage2": next(j for j in decode if j.kernel == "_decode_stage2_kernel"),
        "prefill": next(iter(cc.prefill_jobs(128, 4, 16, torch.bfloat16, ARCH))),
        "rope": next(iter(cc.rope_jobs(128, 4, 16, torch.bfloat16, ARCH))),
        **dict(
            zip(
                ("rms_norm", "fused_add_rms_norm", "silu_and_mul"),
                cc.elementwise_jobs(4096, 14336, torch.bfloat16, ARCH),
            )
        ),
        **{
            f"moe_{i}": job
            for i, job in enumerate(cc.moe_jobs(*cc.MOE_SIZES[0], torch.bfloat16, ARCH, (1, 8192)))
        },
        **{
            f"moe_w8a16_{i}": job
            for i, job in enumerate(
                cc.moe_w8a16_jobs(*cc.MOE_SIZES[1], torch.bfloat16, ARCH, (8192,), (128,))
            )
        },
        "w8a16_block": next(iter(cc.w8a16_jobs(torch.bfloat16, ARCH, (8192,), ((False, 128),)))),
        "w8a16_row": next(iter(cc.w8a16_jobs(torch.bfloat16, ARCH, (1,), ((False, 0),)))),
        "w8a16_affine": next(iter(cc.w8a16_jobs(torch.bfloat16, ARCH, (8192,), ((True, 32),)))),
    }
    return {name: cc.compile_job(job) for name, job in picks.items()}


def test_the_plans_compile_without_spills_within_shared_memory(rows):
    for name, row in rows.items():
        assert not row.error, (name, row.error)
        assert 0 < row.registers <= 255, (name, row)
        assert row.spill_stores == row.spill_loads == 0, (name, row)
        assert row.shared <= cc.ARCHS[ARCH].max_shared and row.problems() == [], (name, row)
    assert (
        rows["split"].shared > 0 and rows["prefill"].shared > 0 and rows["moe_3"].shared > 0
    )  # tl.dot operands staged in shared memory


def test_a_table_row_has_the_expected_fields(rows):
    row = rows["direct"]
    kernel, arch, dtype, shape, regs, spills, shared, flag = cc.table_row(row)
    assert (kernel, arch, dtype, flag) == ("decode_stage1", "sm_90a", "bf16", "")
    assert (
        shape.startswith("direct d=128 gqa=4 bs=16 BLOCK_N=")
        and f"warps={row.job.num_warps}" in shape
    )
    assert (regs, spills, shared) == (str(row.registers), "0/0", str(row.shared))
    assert cc.format_table(list(rows.values())).count("\n") == len(
        rows
    )  # a header and a line per plan


def test_every_kernel_is_in_the_matrix():
    """`make gpu-compile` covers each @triton.jit kernel of kernels/triton/ (the fused ones too)."""
    kernels = {job.kernel for job in cc.all_jobs([ARCH], quick=True)}
    assert (
        kernels
        == set(cc.KERNELS)
        == {
            "_decode_stage1_kernel",
            "_decode_stage2_kernel",
            "_prefill_kernel",
            "_store_kv_kernel",
            "_rms_norm_kernel",
            "_silu_and_mul_kernel",
            "_swiglu_oai_kernel",
            "_rope_store_kv_kernel",
            "_fused_moe_kernel",
            "_fused_moe_w8a16_kernel",
            "_w8a16_kernel",
        }
    )


def test_jobs_are_the_launchers_plans():
    """What compiles is plan_decode's own plan; what changes from step to step (num_splits,
    split_len, the table's width) is not specialized: num_splits == 1 is no constant."""
    plan = plan_decode(256, 32, 8, 128, 16, 2048 // 16, torch.bfloat16, cc.target(ARCH))
    job = next(iter(cc.decode_jobs(128, 4, 16, torch.bfloat16, ARCH)))
    assert plan.num_splits == 1 and job.constexprs == plan.stage1.constexprs
    assert ("num_splits", "i32", False) in job.params and ("stride_bt", "i32", False) in job.params
    assert (job.num_warps, job.num_stages) == (plan.stage1.num_warps, plan.stage1.num_stages)
    prefill = [j for j in cc.all_jobs([ARCH], quick=True) if j.kernel == "_prefill_kernel"]
    sinks = [dict(j.constexprs)["HAS_SINKS"] for j in prefill]
    assert sorted(sinks) == [False, True], "one prompt or many: one binary (gpt-oss's sinks: one)"


def test_arguments_are_specialized_like_the_jit():
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    for value in (0, 1, 16, 17, 4096, -5, 2**31, 0.5):
        for values in (True, False):
            type_, attr = native_specialize_impl(BaseBackend, value, False, values, True)[:2]
            assert cc.specialize(value, values)[0] == type_, (value, values)
            if type_ != "constexpr":
                assert cc.specialize(value, values)[1] == (attr == "D"), (value, values)
    bf16 = native_specialize_impl(
        BaseBackend, torch.empty(8, dtype=torch.bfloat16), False, True, True
    )
    assert cc.specialize("*bf16") == (bf16[0], True)


def test_a_plan_too_large_is_reported():
    """128 x 128 tiles at head_dim 256: more registers than a thread has, more shared memory than
    a block may have; the check must say both and flag the row."""
    job = next(iter(cc.prefill_jobs(256, 4, 16, torch.bfloat16, ARCH, block_m=128, block_n=128)))
    row = cc.compile_job(job)
    problems = row.problems()
    assert any(p.startswith("spills") for p in problems), row
    assert any(p.startswith("shared memory") for p in problems), row
    assert cc.table_row(row)[-1] == "FAIL"


def test_a_compile_error_is_a_failed_row():
    job = next(iter(cc.decode_jobs(128, 4, 16, torch.bfloat16, ARCH)))
    bad = dataclasses.replace(
        job, constexprs=tuple({**dict(job.constexprs), "BLOCK_N": 48}.items())
    )
    row = cc.compile_job(bad)
    assert row.problems() == ["compile error: ValueError: arange's range must be a power of 2"], row
    assert cc.table_row(row)[-1] == "ERROR"


def test_fp32_spills_are_reported_not_failed_and_16_bit_spills_fail():
    """fp32 runs on a GPU only in the first contact's correctness checks: its spills cost speed
    there, not a served token (scripts/gpu_compile.py's Row.problems)."""
    job = next(iter(cc.decode_jobs(64, 3, 16, torch.float32, ARCH, num_kv_heads=3)))
    fp32 = cc.Row(job, registers=255, spill_stores=112, spill_loads=112)
    assert fp32.problems() == [] and cc.table_row(fp32)[-1] == "spills"
    bf16 = dataclasses.replace(fp32, job=dataclasses.replace(job, dtype="bf16"))
    assert bf16.problems() and cc.table_row(bf16)[-1] == "FAIL"


def test_first_contact_jobs_cover_the_first_contacts_kernel_sets():
    """Every (heads, kv heads, head_dim, dtype) bench/first_contact.py checks on a GPU is compiled
    by `gpu_compile.py --first-contact`, with one split, the heuristic's and the most."""
    from types import SimpleNamespace

    from bench import first_contact

    sets, _ = first_contact.kernel_sets(SimpleNamespace(rehearse=False))
    assert set(sets) <= set(cc.FIRST_CONTACT_SETS)
    jobs = list(cc.first_contact_jobs(ARCH))
    for heads, kv_heads, dim, dtype in cc.FIRST_CONTACT_SETS:
        mine = [
            dict(j.constexprs)
            for j in jobs
            if j.kernel == "_decode_stage1_kernel" and j.dtype == cc.TYPE_NAMES[dtype]
            and dict(j.constexprs)["NUM_HEADS"] == heads and dict(j.constexprs)["HEAD_DIM"] == dim
        ]  # fmt: skip
        assert {c["DIRECT"] for c in mine} == {True, False}, (heads, dim, dtype)
    assert len(jobs) > len(set(jobs)) > 40  # shared plans counted once by all_jobs


def test_moe_jobs_are_the_launchers_plans():
    """Each MoE shape compiles the gate/up and down GEMMs at both row-block sizes; the slot count
    (every step's) is no constant, so one binary serves all batch sizes of a block size."""
    jobs = list(cc.moe_jobs(4096, 14336, 8, 2, torch.bfloat16, ARCH, (1, 256, 8192)))
    assert len(set(jobs)) == 4, jobs
    cx = [dict(j.constexprs) for j in dict.fromkeys(jobs)]
    assert {(c["BLOCK_M"], c["N"], c["K"], c["A_PER_TOKEN"], c["MUL_WEIGHTS"]) for c in cx} == {
        (m, n, k, first, not first)
        for m in (16, 64)
        for n, k, first in ((2 * 14336, 4096, True), (4096, 14336, False))
    }
    assert all(("num_slots", "i32", False) in j.params for j in jobs)


def test_moe_w8a16_jobs_are_the_launchers_plans():
    """FP8 experts: each MoE shape's two GEMMs at both row-block sizes, with a scale per row and
    per 128 columns (BLOCK_K inside a group); codes are bytes, scales fp32."""
    jobs = list(cc.moe_w8a16_jobs(2048, 768, 128, 8, torch.bfloat16, ARCH, (1, 256, 8192)))
    assert len(set(jobs)) == 8, jobs
    cx = [dict(j.constexprs) for j in dict.fromkeys(jobs)]
    assert {(c["BLOCK_M"], c["N"], c["GROUP_K"]) for c in cx} == {
        (m, n, g) for m in (16, 64) for n in (2 * 768, 2048) for g in (0, 128)
    }
    assert all(128 % c["BLOCK_K"] == 0 for c in cx)
    assert all(("b_ptr", "*u8", True) in j.params and ("scale_ptr", "*fp32", True) in j.params
               for j in jobs)  # fmt: skip


def test_w8a16_jobs_are_the_launchers_plans():
    """Per dtype and arch: 2 row blocks x 3 code kinds x bias or not; the row count (every
    step's) is no constant, and N and K are run-time arguments."""
    jobs = list(cc.w8a16_jobs(torch.bfloat16, ARCH, (1, 7, 256, 8192)))
    assert len(set(jobs)) == 12, jobs
    cx = [dict(j.constexprs) for j in dict.fromkeys(jobs)]
    assert {(c["BLOCK_M"], c["AFFINE"], c["GROUP_K"], c["HAS_BIAS"]) for c in cx} == {
        (m, a, g, b)
        for m in (16, 64)
        for a, g in ((False, 0), (False, 128), (True, 32))
        for b in (False, True)
    }
    assert all(("M", "i32", False) in j.params and ("K", "i32", True) in j.params for j in jobs)


def test_kernels_option_names_known_kernels_only(capsys):
    """`--kernels` compiles one kernel's plans (e.g. a new kernel's, without the whole matrix);
    a name that is not a kernel is refused before anything compiles."""
    with pytest.raises(SystemExit) as exit_info:
        cc.main(["--kernels", "_fused_moe_w8a16_kernel,_no_such_kernel"])
    assert exit_info.value.code == 2
    assert "_fused_moe_w8a16_kernel" in capsys.readouterr().err
