"""Smoke test of bench/block_size.py at the smallest and largest block size: it runs, counts and
reports, and waste is a fraction that the larger blocks make larger; no times asserted."""

from __future__ import annotations

import json

import pytest

from bench import block_size


@pytest.mark.full
def test_a_tiny_run_at_two_block_sizes(tmp_path, capsys):
    out = tmp_path / "block_size.json"
    res = block_size.main(
        ["--quick", "--block-sizes", "8", "128", "--threads", "1", "--out", str(out)]
    )
    runs = res["runs"]
    assert list(runs) == ["8", "128"]
    for bs, r in runs.items():
        assert r["complete"] and r["useful_tokens"] == res["output_tokens"]
        assert r["block_size"] == int(bs) and r["num_blocks"] * int(bs) == res["kv_slots"]
        for key in ("mean", "peak", "of_cache_mean"):
            assert 0.0 <= r["kv_waste"][key] <= 1.0, (bs, key)
        assert r["kv_waste"]["mean"] <= r["kv_waste"]["peak"]
        assert r["largest_batch"] >= 1 and r["ttft_s"]["p50"] is not None and r["tokens_per_s"] > 0
        assert r["prefix_cache_hit_tokens"] >= 0
    # The same requests on the same slots: half-empty 128-token blocks waste more than 8-token ones.
    assert runs["128"]["kv_waste"]["mean"] >= runs["8"]["kv_waste"]["mean"]
    assert json.loads(out.read_text())["runs"].keys() == runs.keys()
    assert "waste mean" in capsys.readouterr().out
