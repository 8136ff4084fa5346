"""Smoke test of bench/decode_step.py's fp32-vs-fp16 K/V comparison (times are printed, never asserted)."""
from __future__ import annotations

import pytest
import torch

from bench import decode_step, roofline


@pytest.mark.full
def test_kv_fp16_variant_steps_over_an_fp16_copy_of_the_cache(capsys):
    args = decode_step.parse_args(["--kv-fp16", "--batch", "2", "--steps", "2", "--warmup", "1", "--threads", "1"])

    def work():
        eng = decode_step.build_engine(args)
        fp32 = eng.runner.kv_cache
        with decode_step.kv_fp16(eng):
            k, v = eng.runner.kv_cache[0]
            assert k.dtype == v.dtype == torch.float16 and len(eng.runner.kv_cache) == len(fp32)
            assert torch.equal(k.float(), fp32[0][0].half().float()), "the copy holds the cache's contents"
            decode_step.timed_step(eng)
        assert eng.runner.kv_cache is fp32, "the fp32 cache is back after the variant"
        return decode_step.measure(args)

    res = roofline.in_thread(work, 1)
    assert set(res["steps"]) == {"cpu", "cpu-fp16"} and all(len(ts) == 2 for ts in res["steps"].values())
    decode_step.report(args, res)
    assert "cpu / cpu-fp16" in capsys.readouterr().out


@pytest.mark.full
def test_linears_variants_swap_the_packed_copies_and_back(capsys):
    """--linears: the C GEMM's packed weights (codes and fp32) and oneDNN's and F.linear on one batch; the
    runner's own copies are back after each variant, and every variant samples the same tokens
    (greedy, one step from the same state: only the last bits of the sums differ)."""
    from inferline.kernels.cpu import gemm
    from inferline.worker.engine.models.linear import Linear, onednn_available

    if not (gemm.available() and onednn_available()):
        pytest.skip("needs both packed backends")
    args = decode_step.parse_args(["--linears", "--batch", "2", "--steps", "2", "--warmup", "1", "--threads", "1"])

    def work():
        eng = decode_step.build_engine(args)
        model = eng.runner.model
        own = [m.packed for m in model.modules() if isinstance(m, Linear)] + [model.lm_head_packed]
        for name, kind in (("c-codes", gemm.CodedWeight), ("c-gemm", gemm.PackedWeight), ("onednn", torch.Tensor)):
            with decode_step.VARIANTS[name](eng):
                assert isinstance(model.lm_head_packed, kind)
                assert all(isinstance(m.packed, kind) for m in model.modules() if isinstance(m, Linear))
        assert [m.packed for m in model.modules() if isinstance(m, Linear)] + [model.lm_head_packed] == own
        return decode_step.measure(args)

    res = roofline.in_thread(work, 1)
    assert set(res["steps"]) == {"c-codes", "c-gemm", "onednn", "mkl"} and all(len(ts) == 2 for ts in res["steps"].values())
    decode_step.report(args, res)
    out = capsys.readouterr().out
    assert "onednn / c-gemm" in out and "c-gemm / c-codes" in out


@pytest.mark.full
def test_linear_backends_bench_times_every_backend(capsys):
    from bench import linear_backends
    from inferline.kernels.cpu import gemm

    if not gemm.available():
        pytest.skip("the CPU kernels did not build")
    table = linear_backends.main(["--rows", "3", "--repeats", "1", "--threads", "1"])
    # the default model's weights (a GGUF's Q4_1 and Q8_0) have exact 8-bit codes: timed as well
    assert set(table) == {3} and {"c", "c+codes", "mkl"} <= set(table[3]) and all(t > 0 for t in table[3].values())
    assert "rows    3  GFLOP/s: c" in capsys.readouterr().out


def test_the_roofline_takes_the_faster_packed_backend():
    """The roofline is the machine's best rate whichever backend the model runs on."""
    from inferline.worker.engine.models.loader import load_model

    model, _, _ = load_model("", "dummy", torch.float32, torch.device("cpu"), max_positions=64)
    roof = roofline.in_thread(lambda: roofline.measure(model, batches=(4,), repeats=1), 1)
    backends = roofline._packing_backends(model)
    assert roof["backend"] in (backends or ["torch"]) and roof["by_batch"]["4"]["tokens_per_s"] == roof["tokens_per_s"]
    assert "c+codes" not in backends  # random weights have no exact 8-bit codes
