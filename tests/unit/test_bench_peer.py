"""bench/peer_llamacpp.py's pure parts: arguments, the workload's lengths, the server's context
and the backends read from a worker's metrics. The llama.cpp build and the runs themselves are
`make bench-peer`, not tests."""

from __future__ import annotations

import pytest

from bench import peer_llamacpp as peer


def test_arguments_need_a_server_unless_it_is_skipped():
    with pytest.raises(SystemExit):
        peer.parse_args([])
    args = peer.parse_args(["--server-bin", "/x/llama-server"])
    assert (args.num_requests, args.parallel, args.linear) == (48, 16, ["auto", "c", "onednn"])
    quick = peer.parse_args(["--skip-llamacpp", "--quick", "--linear", "c"])
    assert (
        quick.num_requests == 4
        and quick.max_output == 8 == quick.min_output
        and quick.linear == ["c"]
    )


def test_output_lengths_are_lognormal_around_the_median_and_clipped():
    lengths = peer.lognormal_lengths(2000, 96, 0.6, 8, 384, seed=0)
    assert min(lengths) >= 8 and max(lengths) <= 384 and max(lengths) == 384
    assert 85 <= sorted(lengths)[1000] <= 107
    assert lengths[:10] == peer.lognormal_lengths(10, 96, 0.6, 8, 384, seed=0)


def test_the_server_context_gives_every_slot_a_whole_request():
    ctx = peer.server_ctx(16, 300, 384)
    assert ctx % 16 == 0 and ctx // 16 >= 300 + 384 and ctx // 16 % 256 == 0


def test_backend_info_is_read_from_the_metrics():
    text = """# HELP inferline_kernel_backend_info 1 for each kernel backend
inferline_kernel_backend_info{backend="cpu",how="set",kind="attention"} 1.0
inferline_kernel_backend_info{backend="c",how="timed",kind="linear"} 1.0
inferline_kernel_backend_info{backend="c",how="set",kind="fused_ops"} 1.0
inferline_batch_size 0.0"""
    assert peer.parse_backend_info(text) == {
        "attention": {"backend": "cpu", "how": "set"},
        "linear": {"backend": "c", "how": "timed"},
        "fused_ops": {"backend": "c", "how": "set"},
    }
