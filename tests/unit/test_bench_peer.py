"""bench/peer_llamacpp.py's pure parts: arguments, the workload's lengths, the run order and the
report's maths. The llama.cpp build and the runs themselves are `make bench-peer`, not tests."""
from __future__ import annotations

import pytest

from bench import peer_llamacpp as peer


def test_arguments_need_a_server_unless_it_is_skipped():
    with pytest.raises(SystemExit):
        peer.parse_args([])
    args = peer.parse_args(["--server-bin", "/x/llama-server"])
    assert (args.num_requests, args.parallel, args.linear) == (48, 16, ["auto", "c", "onednn"])
    quick = peer.parse_args(["--skip-llamacpp", "--quick", "--linear", "c"])
    assert quick.num_requests == 4 and quick.max_output == 8 == quick.min_output and quick.linear == ["c"]


def test_output_lengths_are_lognormal_around_the_median_and_clipped():
    lengths = peer.lognormal_lengths(2000, 96, 0.6, 8, 384, seed=0)
    assert min(lengths) >= 8 and max(lengths) <= 384 and max(lengths) == 384
    assert 85 <= sorted(lengths)[1000] <= 107
    assert lengths[:10] == peer.lognormal_lengths(10, 96, 0.6, 8, 384, seed=0)


def test_runs_alternate_abba():
    assert peer.schedule(["l", "a", "c"], 2) == ["l", "a", "c", "c", "a", "l"]


def test_the_server_context_gives_every_slot_a_whole_request():
    ctx = peer.server_ctx(16, 300, 384)
    assert ctx % 16 == 0 and ctx // 16 >= 300 + 384 and ctx // 16 % 256 == 0


def test_summary_takes_medians_and_ratios_to_llamacpp():
    def run(path, tps, p50, p99=None, complete=True):
        return {"path": path, "tokens_per_s": tps, "ttft_s": {"p50": p50, "p99": p99 or 2 * p50}, "complete": complete}

    table = peer.summarize([run("llamacpp", 100, 10), run("inferline-auto", 200, 2), run("inferline-auto", 180, 4),
                            run("llamacpp", 120, 12), run("inferline-auto", 300, 1, complete=False)])
    assert table["llamacpp"]["tokens_per_s"] == 110 and table["llamacpp"]["runs"] == 2
    auto = table["inferline-auto"]
    assert auto["tokens_per_s"] == 200 and auto["ttft_p50_s"] == 2 and not auto["complete"]
    assert auto["vs_llamacpp"]["tokens_per_s"] == pytest.approx(200 / 110)
    assert auto["vs_llamacpp"]["ttft_p50"] == pytest.approx(2 / 11)
    assert "vs_llamacpp" not in table["llamacpp"]
    assert "vs_llamacpp" not in peer.summarize([run("inferline-c", 5, 1)])["inferline-c"]


def test_run_stats():
    stats = peer.run_stats([1.0, 2.0, 3.0], 300, 2.0)
    assert stats["tokens_per_s"] == 150 and stats["ttft_s"]["p50"] == 2.0 and stats["ttft_s"]["n"] == 3


def test_backend_info_is_read_from_the_metrics():
    text = """# HELP inferline_kernel_backend_info 1 for each kernel backend
inferline_kernel_backend_info{backend="cpu",how="set",kind="attention"} 1.0
inferline_kernel_backend_info{backend="c",how="timed",kind="linear"} 1.0
inferline_kernel_backend_info{backend="c",how="set",kind="fused_ops"} 1.0
inferline_batch_size 0.0"""
    assert peer.parse_backend_info(text) == {"attention": {"backend": "cpu", "how": "set"},
                                             "linear": {"backend": "c", "how": "timed"},
                                             "fused_ops": {"backend": "c", "how": "set"}}
