"""Smoke test of the Kafka end-to-end benchmark (bench/kafka_e2e.py): 4 requests x 4 tokens
through the engine in-process and through broker + worker subprocess + client.

It checks the shape and sanity of the JSON the benchmark writes, never a speed: the ratio is
measured by `python -m bench.kafka_e2e`, not asserted here.
"""

from __future__ import annotations

import json
import math

import pytest

from bench import kafka_e2e

# A bench smoke run: `make test-full` (make test stays under its 20 minutes).
pytestmark = [pytest.mark.kafka, pytest.mark.full]

RUN_KEYS = {
    "path",
    "label",
    "wall_s",
    "useful_tokens",
    "complete",
    "tokens_per_s",
    "ttft_s",
    "engine",
    "e2e_s",
}
COMPARISON_KEYS = {
    "table",
    "throughput_ratio",
    "ttft_p50_diff_ms",
    "kafka_ttft_overhead_p50_ms",
    "throughput_met",
    "ttft_met",
}


@pytest.fixture(scope="module")
def results(kafka_bootstrap, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-kafka") / "kafka_e2e.json"
    kafka_e2e.main(
        ["--quick", "--num-requests", "4", "--max-output", "4", "--threads", "1", "--out", str(out)]
    )
    return json.loads(out.read_text())


def test_writes_both_paths_and_the_comparison(results):
    assert {
        "command",
        "machine",
        "workload",
        "settings",
        "runs",
        "comparison",
        "greedy_agreement",
        "targets",
    } <= results.keys()
    assert [r["path"] for r in results["runs"]] == ["in_process", "kafka"]
    assert COMPARISON_KEYS <= results["comparison"].keys()
    assert results["workload"]["num_requests"] == 4 and results["workload"]["total_output"] == 16


def test_every_request_completes_with_the_same_tokens(results):
    for run in results["runs"]:
        assert RUN_KEYS <= run.keys(), run["label"]
        assert run["complete"] and run["useful_tokens"] == 16, run["label"]
        assert run["tokens_per_s"] > 0 and math.isfinite(run["tokens_per_s"]), run["label"]
        assert run["ttft_s"]["n"] == 4 and 0 < run["ttft_s"]["p50"] <= run["wall_s"], run["label"]
        assert run["engine"]["steps"] >= 4, run["label"]  # 4 tokens each: at least 4 steps
    assert results["greedy_agreement"] == {"in_process": 4, "kafka": 4}
    kafka = results["runs"][1]
    assert kafka["completed"] == 4 and kafka["ttft_overhead_s"]["n"] == 4


def test_ratio_is_consistent(results):
    c = results["comparison"]
    eng, kaf = c["table"]["in_process"], c["table"]["kafka"]
    assert c["throughput_ratio"] == pytest.approx(kaf["tokens_per_s"] / eng["tokens_per_s"])
    assert c["ttft_p50_diff_ms"] == pytest.approx(1e3 * (kaf["ttft_p50_s"] - eng["ttft_p50_s"]))


def test_both_paths_run_without_prefix_caching(monkeypatch):
    """The worker serves every repeat from one process: with prefix caching its second run would
    find the first run's prompts cached while each in-process run starts cold."""
    from inferline.config.settings import Settings

    args = kafka_e2e.parse_args(["--quick"])
    settings = kafka_e2e.bench_settings(args)
    assert not settings.cache.enable_prefix_caching
    env = kafka_e2e.worker_env(settings, kafka_e2e.Topics("t"), 1234)
    for key, value in env.items():
        if key.startswith("INFERLINE_"):
            monkeypatch.setenv(key, value)
    assert Settings().cache.enable_prefix_caching is False  # what the worker will read
