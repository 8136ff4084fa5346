"""Smoke test of the gateway benchmark (bench/gateway.py) on the real broker: 3 requests x 4
tokens straight onto Kafka and through the gateway with the openai SDK. Shapes and sanity
only, never a speed."""

from __future__ import annotations

import json

import pytest

from bench import gateway


@pytest.fixture(scope="module")
def results(kafka_bootstrap, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-gateway") / "gateway.json"
    gateway.main(
        [
            "--quick",
            "--num-requests",
            "3",
            "--max-output",
            "4",
            "--concurrency",
            "2",
            "--threads",
            "1",
            "--probe",
            "2",
            "--out",
            str(out),
        ]
    )
    return json.loads(out.read_text())


@pytest.mark.kafka
@pytest.mark.full
def test_both_loads_complete_with_every_token(results):
    assert [r["client"] for r in results["runs"]] == ["kafka", "sdk"]
    assert results["workload"]["num_requests"] == 3 and results["workload"]["total_output"] == 12
    for run in results["runs"]:
        assert run["complete"] and run["useful_tokens"] == 12, run["label"]
        assert run["ttft_s"]["n"] == 3 and 0 < run["ttft_s"]["p50"] <= run["wall_s"], run["label"]


@pytest.mark.kafka
@pytest.mark.full
def test_the_comparison_is_the_ratio_of_the_runs(results):
    kafka, sdk = results["runs"]
    c = results["comparison"]["sdk"]
    assert c["throughput_ratio"] == pytest.approx(sdk["tokens_per_s"] / kafka["tokens_per_s"])
    assert c["ttft_p50_diff_ms"] == pytest.approx(
        1e3 * (sdk["ttft_s"]["p50"] - kafka["ttft_s"]["p50"])
    )
    probe = results["idle_probe"]
    assert (
        probe["kafka_ttft_s"]["n"] == probe["sdk_ttft_s"]["n"] == probe["paired_diff_ms"]["n"] == 2
    )
