"""The gateway benchmark's offline parts (bench/gateway.py, bench/gateway_loads.py): the guidellm
scenario and its report parsed from a fixed sample (guidellm is an optional install), and the
client checks. The runs on the broker: tests/kafka/test_bench_gateway.py."""
from __future__ import annotations


import pytest

from bench import gateway
from bench.gateway_loads import guidellm_requests, guidellm_scenario


def test_guidellm_scenario_and_report():
    spec = guidellm_scenario("http://h:1", "d.jsonl", "tok", "o.json", 5, 3)["spec"]
    assert spec["profile"] == {"kind": "concurrent", "streams": [3]}
    assert spec["constraints"] == [{"kind": "max_requests", "count": 5}]
    assert spec["backend"]["target"] == "http://h:1" and spec["tokenizer"]["model"] == "tok"

    def request(start, first, end, tokens):
        return {"output_tokens": tokens, "info": {"timings": {"request_start": start, "first_token_iteration": first,
                                                              "request_end": end}}}

    report = {"benchmarks": [{"requests": {"successful": [request(1.0, 1.5, 3.0, 8)],
                                           "errored": [request(2.0, None, 2.5, 0)], "incomplete": []}}]}
    ok, failed = guidellm_requests(report)
    assert (ok.start, ok.first, ok.end, ok.tokens, ok.ok) == (1.0, 1.5, 3.0, 8, True)
    assert not failed.ok and failed.first is None


def test_clients_are_checked_and_guidellm_is_optional(monkeypatch, tmp_path):
    with pytest.raises(SystemExit):
        gateway.parse_args(["--clients", "kafka,curl"])
    assert gateway.parse_args(["--clients", "sdk,kafka"]).clients == ["sdk", "kafka"]
    monkeypatch.setattr(gateway, "GUIDELLM_VENV", tmp_path / "none")
    monkeypatch.setattr(gateway.shutil, "which", lambda _name: None)
    assert gateway.parse_args([]).clients == ["kafka", "sdk"]  # not installed: left out by default
    with pytest.raises(SystemExit):
        gateway.parse_args(["--clients", "guidellm"])  # asked for by name: an error
