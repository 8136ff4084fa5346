"""Smoke test of bench/kv_dtype.py (fp32 vs fp16 K/V, ABBA): it runs, counts and reports; no times asserted."""
from __future__ import annotations

import pytest

from bench import kv_dtype


@pytest.mark.full
def test_both_caches_run_every_request_twice(capsys):
    res = kv_dtype.main(["--num-requests", "3", "--max-output", "6", "--threads", "1"])
    assert [len(res["runs"][d]) for d in ("auto", "float16")] == [2, 2]
    for runs in res["runs"].values():
        assert all(r["complete"] and r["useful_tokens"] == 3 * 6 for r in runs)
    assert 0 <= res["same_greedy"] <= res["num_requests"] == 3 and res["fp16_over_fp32"] > 0
    assert "fp16 / fp32" in capsys.readouterr().out
