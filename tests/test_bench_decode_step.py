"""Smoke test of bench/decode_step.py's fp32-vs-fp16 K/V comparison (times are printed, never asserted)."""
from __future__ import annotations

import torch

from bench import decode_step, roofline


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
