"""Smoke test of the engine benchmark (bench/engine.py): a tiny workload through every mode.

It checks the shape and sanity of what the benchmark writes, never a speed: speed is a ratio
measured by `make bench`, not a test assertion.
"""

from __future__ import annotations

import json
import math

import pytest

from bench import engine as bench_engine
from bench.workload import make_workload, with_arrivals

RUN_KEYS = {
    "tokens_per_s",
    "tokens_per_cpu_s",
    "useful_tokens",
    "ttft_s",
    "itl_s",
    "e2e_s",
    "mean_batch_size",
    "mean_running",
    "kv_usage",
    "preemptions",
    "complete",
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "engine.json"
    bench_engine.main(
        [
            "--quick",
            "--num-requests",
            "4",
            "--max-output",
            "8",
            "--rate",
            "50",
            "--out",
            str(out),
            "--threads",
            "1",
        ]
    )
    return json.loads(out.read_text())


@pytest.mark.full
def test_repeats_run_each_engine_mode_in_abba_order(tmp_path, monkeypatch):
    labels = []
    real = bench_engine.run_engine
    monkeypatch.setattr(
        bench_engine,
        "run_engine",
        lambda runner, settings, items, label: (
            labels.append(label) or real(runner, settings, items, label)
        ),
    )
    data = bench_engine.main(
        [
            "--quick",
            "--num-requests",
            "3",
            "--max-output",
            "4",
            "--skip-hf",
            "--rate",
            "0",
            "--repeats",
            "3",
            "--out",
            str(tmp_path / "e.json"),
            "--threads",
            "1",
        ]
    )
    s, c = "engine_static", "engine_continuous"
    assert labels == [s, c, c, s, s, c]
    assert all(data["runs"][m]["complete"] for m in (s, c)) and "poisson" not in data
    with pytest.raises(SystemExit):
        bench_engine.parse_args(["--repeats", "0"])


@pytest.mark.full
def test_writes_every_mode_and_the_poisson_runs(results):
    data = results
    assert {
        "runs",
        "roofline",
        "ratios",
        "targets",
        "workload",
        "poisson",
        "machine",
    } <= data.keys()
    assert set(data["runs"]) == {"hf_static16", "engine_static", "engine_continuous"}
    assert set(data["poisson"]["runs"]) == {"engine_static", "engine_continuous"}


@pytest.mark.full
def test_every_mode_completes_every_request(results):
    data = results
    total = data["workload"]["total_output"]
    assert total == 4 * 8
    for label, run in [*data["runs"].items(), *data["poisson"]["runs"].items()]:
        assert RUN_KEYS <= run.keys(), label
        assert run["complete"] and run["useful_tokens"] == total, label
        assert run["tokens_per_s"] > 0 and math.isfinite(run["tokens_per_s"]), label
        assert 0 <= run["ttft_s"]["p50"] <= run["ttft_s"]["p99"], label
        assert 0 < run["itl_s"]["p50"] <= run["itl_s"]["p99"], label
    for label in ("engine_static", "engine_continuous"):
        run = data["runs"][label]
        assert 0 < run["kv_usage"]["peak"] <= 1 and run["preemptions"] == 0
        assert 1 <= run["mean_batch_size"] <= 4


@pytest.mark.full
def test_greedy_tokens_agree_across_modes(results):
    assert results["greedy_agreement"] == {"engine_static": 4, "engine_continuous": 4}


@pytest.mark.full
def test_roofline_and_ratios(results):
    roof = results["roofline"]
    # SmolLM2-135M: 2 x 106 M decoder linear weights + 2 x 28 M lm_head.
    assert 2.6e8 < roof["flops_per_token"]["total"] < 2.8e8
    assert roof["gflops"] > 0 and roof["tokens_per_s"] > 0
    assert set(results["ratios"]) == set(bench_engine.TARGETS)
    assert all(v > 0 for v in results["ratios"].values())


def test_workload_is_deterministic_and_varied():
    from inferline.worker.engine.models.loader import load_tokenizer

    tok = load_tokenizer(None)
    a = make_workload(tok, 16, seed=3)
    b = make_workload(tok, 16, seed=3)
    assert [(i.prompt_token_ids, i.max_tokens) for i in a] == [
        (i.prompt_token_ids, i.max_tokens) for i in b
    ]
    assert all(8 <= i.max_tokens <= 256 for i in a) and len({i.max_tokens for i in a}) > 8
    lengths = [len(i.prompt_token_ids) for i in a]
    assert min(lengths) >= 31 + 5 and max(lengths) <= 31 + 275 and max(lengths) - min(lengths) > 100
    timed = with_arrivals(a, rate=4.0, seed=3)
    arrivals = [i.arrival_s for i in timed]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
