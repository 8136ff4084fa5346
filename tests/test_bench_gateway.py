"""Smoke test of the gateway benchmark (bench/gateway.py): 3 requests x 4 tokens straight onto
Kafka and through the gateway with the openai SDK, and a 2-pair idle probe (guidellm is an
optional install: its report is parsed from a fixed sample instead). Shapes and sanity only,
never a speed."""
from __future__ import annotations

import json

import pytest

from bench import gateway
from bench.gateway_loads import guidellm_requests, guidellm_scenario


@pytest.fixture(scope="module")
def results(kafka_bootstrap, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-gateway") / "gateway.json"
    gateway.main(["--quick", "--num-requests", "3", "--max-output", "4", "--concurrency", "2",
                  "--clients", "kafka,sdk", "--threads", "1", "--probe", "2", "--out", str(out)])
    return json.loads(out.read_text())


@pytest.mark.kafka
def test_both_loads_complete_with_every_token(results):
    assert [r["client"] for r in results["runs"]] == ["kafka", "sdk"]
    assert results["workload"]["num_requests"] == 3 and results["workload"]["output_tokens"]["total"] == 12
    for run in results["runs"]:
        assert run["complete"] and run["useful_tokens"] == 12, run["label"]
        assert run["ttft_s"]["n"] == 3 and 0 < run["ttft_s"]["p50"] <= run["wall_s"], run["label"]
        assert run["cpu_s"]["gateway"] is not None and run["cpu_s"]["worker"] > 0, run["label"]
    kafka, sdk = results["runs"]
    # The gateway's own TTFT histogram moved for the sdk load only.
    assert kafka["gateway_ttft_mean_s"] is None and 0 < sdk["gateway_ttft_mean_s"] <= sdk["wall_s"]


@pytest.mark.kafka
def test_the_comparison_is_the_ratio_of_the_runs(results):
    kafka, sdk = results["runs"]
    c = results["comparison"]["sdk"]
    assert c["throughput_ratio"] == pytest.approx(sdk["tokens_per_s"] / kafka["tokens_per_s"])
    assert c["ttft_p50_diff_ms"] == pytest.approx(1e3 * (sdk["ttft_s"]["p50"] - kafka["ttft_s"]["p50"]))
    probe = results["idle_probe"]
    assert probe["kafka_ttft_s"]["n"] == probe["sdk_ttft_s"]["n"] == probe["paired_diff_ms"]["n"] == 2


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
