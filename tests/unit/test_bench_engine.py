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

RUN_KEYS = {"tokens_per_s", "tokens_per_cpu_s", "useful_tokens", "ttft_s", "itl_s", "e2e_s",
            "mean_batch_size", "mean_running", "kv_usage", "preemptions", "completion_curve", "complete"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    bench_engine.main(["--quick", "--num-requests", "4", "--max-output", "8", "--rate", "50",
                       "--profile-steps", "2", "--out-dir", str(out), "--no-progress", "--threads", "1"])
    return json.loads((out / "engine.json").read_text()), out


@pytest.mark.full
def test_repeats_alternate_the_engine_modes_and_report_the_median(tmp_path):
    data = bench_engine.main(["--quick", "--num-requests", "3", "--max-output", "4", "--skip-hf", "--rate", "0",
                              "--repeats", "3", "--out-dir", str(tmp_path), "--no-progress", "--threads", "1"])
    rep = data["repeats"]
    assert [len(rep["tokens_per_s"][m]) for m in ("engine_static", "engine_continuous")] == [3, 3]
    for mode, runs in rep["tokens_per_s"].items():
        assert data["runs"][mode]["tokens_per_s"] == sorted(runs)[1] and data["runs"][mode]["complete"]
    pairs = rep["continuous_over_static"]
    assert len(pairs) == 3 and rep["continuous_over_static_range"] == [min(pairs), max(pairs)]
    with pytest.raises(SystemExit):
        bench_engine.parse_args(["--repeats", "0"])


def test_alternate_modes_runs_forward_then_backward(monkeypatch):
    calls = []
    monkeypatch.setattr(bench_engine, "run_engine", lambda runner, settings, items, label, progress:
                        calls.append(label))
    runs = bench_engine.alternate_modes(None, {"s": 1, "c": 2}, [], 3, False)
    assert calls == ["s", "c", "c", "s", "s", "c"] and {k: len(v) for k, v in runs.items()} == {"s": 3, "c": 3}


@pytest.mark.full
def test_writes_json_and_plot(results):
    data, out = results
    assert (out / "engine.png").stat().st_size > 1000
    assert {"runs", "roofline", "ratios", "targets", "workload", "poisson", "profile"} <= data.keys()
    assert set(data["runs"]) == {"hf_static16", "engine_static", "engine_continuous"}
    assert set(data["poisson"]["runs"]) == {"engine_static", "engine_continuous"}


@pytest.mark.full
def test_every_mode_completes_every_request(results):
    data, _ = results
    total = data["workload"]["output_tokens"]["total"]
    assert total == 4 * 8
    for label, run in [*data["runs"].items(), *data["poisson"]["runs"].items()]:
        assert RUN_KEYS <= run.keys(), label
        assert run["complete"] and run["useful_tokens"] == total, label
        assert run["tokens_per_s"] > 0 and math.isfinite(run["tokens_per_s"]), label
        assert 0 <= run["ttft_s"]["p50"] <= run["ttft_s"]["p99"], label
        assert 0 < run["itl_s"]["p50"] <= run["itl_s"]["p99"], label
        assert run["completion_curve"][-1][1] == total, label
    for label in ("engine_static", "engine_continuous"):
        run = data["runs"][label]
        assert 0 < run["kv_usage"]["peak"] <= 1 and run["preemptions"] == 0
        assert 1 <= run["mean_batch_size"] <= 4


@pytest.mark.full
def test_greedy_tokens_agree_across_modes(results):
    data, _ = results
    assert data["greedy_agreement"] == {"engine_static_vs_hf_static16": 4, "engine_continuous_vs_hf_static16": 4}


@pytest.mark.full
def test_roofline_and_ratios(results):
    data, _ = results
    roof = data["roofline"]
    # SmolLM2-135M: 2 x 106 M decoder linear weights + 2 x 28 M lm_head.
    assert 2.6e8 < roof["flops_per_token"]["total"] < 2.8e8
    assert roof["gflops"] > 0 and roof["tokens_per_s"] > 0
    assert set(data["ratios"]) == {"continuous_over_hf", "continuous_over_static", "roofline_fraction"}
    assert all(v > 0 for v in data["ratios"].values())
    assert data["targets"] == {"continuous_over_hf": 5.0, "continuous_over_static": 1.6, "roofline_fraction": 0.4}
    assert data["profile"]["num_steps"] >= 1 and data["profile"]["top_self_cpu"]


@pytest.mark.full
def test_ceiling_counts_prompt_work(results, capsys):
    data, _ = results
    c, w, roof = data["ceiling"], data["workload"], data["roofline"]
    fpt = roof["flops_per_token"]
    prompt, output, n = w["prompt_tokens"]["total"], w["output_tokens"]["total"], w["num_requests"]
    flops = (prompt + output - n) * fpt["decoder_linears"] + output * fpt["lm_head"]
    assert c["output_tokens_per_s_at_roofline"] == pytest.approx(output * roof["gflops"] * 1e9 / flops)
    assert c["roofline_fraction_at_best"] < 1, "prompts cost work, so output alone cannot reach the roofline"
    cont = data["runs"]["engine_continuous"]
    hits = cont["prefix_cache_hit_tokens"]
    assert cont["prefix_caching"] and c["continuous_prefix_cache_hit_tokens"] == hits >= 0
    # A ratio of two timings (the run's FLOP/s over the roofline's, each measured once here, on a
    # shared machine): only a unit error (1000x) may fail it, never a noisy measurement.
    assert 0 < c["continuous_flops_utilization"] < 10
    bench_engine.print_ceiling(c)
    assert f"{c['output_tokens_per_s_at_roofline']:.0f} output tok/s" in capsys.readouterr().out


def test_workload_is_deterministic_and_varied():
    from inferline.worker.engine.models.loader import load_tokenizer

    tok = load_tokenizer(None)
    a = make_workload(tok, 16, seed=3)
    b = make_workload(tok, 16, seed=3)
    assert [(i.prompt_token_ids, i.max_tokens) for i in a] == [(i.prompt_token_ids, i.max_tokens) for i in b]
    assert all(8 <= i.max_tokens <= 256 for i in a) and len({i.max_tokens for i in a}) > 8
    lengths = [len(i.prompt_token_ids) for i in a]
    assert min(lengths) >= 31 + 5 and max(lengths) <= 31 + 275 and max(lengths) - min(lengths) > 100
    timed = with_arrivals(a, rate=4.0, seed=3)
    arrivals = [i.arrival_s for i in timed]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals[-1] > 0


@pytest.mark.full
def test_kv_dtype_option_reaches_every_engine_mode(results):
    data, _ = results
    assert data["kv_dtype"] == "float32", "the default run keeps the model's dtype"
    args = bench_engine.parse_args(["--kv-dtype", "float16"])
    assert args.kv_dtype == "float16"
    for policy in ("static", "continuous"):
        assert bench_engine.engine_settings(policy, 16, 512, True, args.kv_dtype).cache.dtype == "float16"
