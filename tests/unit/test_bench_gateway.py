"""The gateway benchmark's offline part (bench/gateway.py): its arguments. The runs on the broker:
tests/kafka/test_bench_gateway.py."""

from __future__ import annotations

from bench import gateway


def test_quick_runs_each_load_once_and_probes_a_few():
    args = gateway.parse_args(["--quick"])
    assert (args.num_requests, args.max_output, args.repeats, args.probe) == (4, 8, 1, 4)
    full = gateway.parse_args([])
    assert (full.num_requests, full.max_output, full.repeats, full.concurrency) == (32, 96, 2, 16)
