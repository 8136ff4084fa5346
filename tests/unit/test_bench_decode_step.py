"""Smoke tests of bench/decode_step.py's modes (times are printed, never asserted)."""

from __future__ import annotations

import pytest
import torch

from bench import decode_step, roofline


@pytest.mark.full
def test_linears_variants_swap_the_packed_copies_and_back(capsys):
    """--linears: the C GEMM's packed weights (codes and fp32), oneDNN's and F.linear on one
    batch; the runner's own copies are back after each variant."""
    from inferline.kernels.cpu import gemm
    from inferline.worker.engine.models.linear import Linear, onednn_available

    if not (gemm.available() and onednn_available()):
        pytest.skip("needs both packed backends")
    args = decode_step.parse_args(
        ["--linears", "--batch", "2", "--steps", "2", "--warmup", "1", "--threads", "1"]
    )

    def work():
        eng = decode_step.build_engine(args)
        model = eng.runner.model
        own = [m.packed for m in model.modules() if isinstance(m, Linear)] + [model.lm_head_packed]
        kinds = (
            ("c-codes", gemm.CodedWeight),
            ("c-gemm", gemm.PackedWeight),
            ("onednn", torch.Tensor),
            ("mkl", type(None)),
        )
        for name, kind in kinds:
            with decode_step.VARIANTS[name](eng):
                assert isinstance(model.lm_head_packed, kind)
                assert all(
                    isinstance(m.packed, kind) for m in model.modules() if isinstance(m, Linear)
                )
        assert [m.packed for m in model.modules() if isinstance(m, Linear)] + [
            model.lm_head_packed
        ] == own
        return decode_step.measure_steps(args)

    res = roofline.in_thread(work, 1)
    assert set(res["steps"]) == {"c-codes", "c-gemm", "onednn", "mkl"}
    assert all(len(ts) == 2 for ts in res["steps"].values()) and res["floor"]
    decode_step.report_steps(args, res)
    out = capsys.readouterr().out
    assert "onednn / c-gemm" in out and "c-gemm / c-codes" in out


@pytest.mark.full
def test_compare_times_every_variant_and_prices_attention(capsys):
    res = decode_step.main(
        ["--compare", "--batch", "2", "--steps", "1", "--warmup", "1", "--threads", "1"]
    )
    assert set(res["steps"]) == {"torch", "cpu", "mkl", "unfused", "no-attn"}
    assert "decode attention per step" in capsys.readouterr().out


def test_prep_times_each_context(capsys):
    res = decode_step.main(
        ["--prep", "--seqs", "4", "--context", "40", "300", "--steps", "3", "--threads", "1"]
    )
    assert set(res) == {40, 300} and all(us > 0 for us in res.values())
    assert "4 seqs x    300 context" in capsys.readouterr().out


def test_the_roofline_times_the_models_own_linear_layers():
    from inferline.worker.engine.models.loader import load_model

    model, _, _ = load_model("", "dummy", torch.float32, torch.device("cpu"), max_positions=64)
    roof = roofline.in_thread(lambda: roofline.measure(model, batches=(4, 8), repeats=1), 1)
    assert set(roof["by_batch"]) == {"4", "8"} and roof["gflops"] > 0
    assert roof["tokens_per_s"] == max(r["tokens_per_s"] for r in roof["by_batch"].values())
