"""The broker-cost benchmark's offline parts (bench/broker_cost.py): the launcher that runs a worker
of another tree, the metric it reads and the per-request arithmetic. The run on a broker:
tests/kafka/test_bench_broker_cost.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench import broker_cost


def test_launcher_runs_the_named_trees_worker_not_the_installed_one(tmp_path):
    worker = tmp_path / "worker"
    worker.mkdir()
    (worker / "__init__.py").write_text("")
    (worker / "__main__.py").write_text(
        "import inferline.worker, sys\nprint('main of', inferline.worker.__file__, sys.argv[1:])\n"
    )
    done = subprocess.run(
        [sys.executable, "-P", "-c", broker_cost.LAUNCH, str(tmp_path), "--flag"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert f"main of {worker / '__init__.py'} ['--flag']" in done.stdout
    assert f"from {worker / '__init__.py'}" in done.stderr


def test_transactions_by_outcome_from_the_metrics_text():
    samples = {
        'inferline_transactions_total{outcome="committed"}': 12.0,
        'inferline_transactions_total{outcome="aborted"}': 1.0,
        'inferline_transactions_created{outcome="committed"}': 1.7e9,
        'inferline_requests_total{outcome="length"}': 30.0,
    }
    assert broker_cost.transactions(samples) == {"committed": 12.0, "aborted": 1.0}
    assert broker_cost.transactions({}) == {}


def run(**over) -> dict:
    base = {
        "served": 100,
        "window_s": 5.0,
        "broker_cpu_s": 1.2,
        "worker_cpu_s": 0.5,
        "idle_broker_cpu_per_s": 0.02,
        "idle_worker_cpu_per_s": 0.04,
        "transactions": {"committed": 25.0},
    }
    return broker_cost.figures({**base, **over})


def test_figures_per_served_request():
    r = run()
    assert r["transactions_per_request"] == pytest.approx(0.25)
    assert r["broker_cpu_ms_raw"] == pytest.approx(12.0)
    assert r["broker_cpu_ms"] == pytest.approx(12.0 - 1e3 * 0.02 * 5.0 / 100)  # 11.0
    assert r["broker_cpu_ms_less_idle_worker"] == pytest.approx(10.0)
    assert r["worker_cpu_ms"] == pytest.approx(5.0)
    assert r["idle_broker_ms_per_s"] == pytest.approx(20.0)
    assert r["target_met"] is False
    assert run(broker_cpu_s=1.0)["target_met"] is True  # 10 - 1 ms


def test_figures_without_a_broker_pid_or_a_served_request():
    r = run(broker_cpu_s=None, idle_broker_cpu_per_s=None, idle_worker_cpu_per_s=None)
    assert r["broker_cpu_ms"] is None and r["target_met"] is None
    none = run(served=0, transactions={})
    assert none["transactions_per_request"] is None and none["broker_cpu_ms"] is None


def test_idle_window_defaults_to_the_measured_one():
    args = broker_cost.parse_args(["--requests", "300", "--rate", "30"])
    assert args.idle_s == pytest.approx(10.0) and not args.no_baseline
    with pytest.raises(SystemExit):
        broker_cost.parse_args(["--baseline", "main", "--no-baseline"])


def test_summary_compares_the_current_tree_with_the_baseline():
    runs = [
        {**run(), "side": "baseline"},
        {**run(transactions={"committed": 10.0}, broker_cpu_s=0.7), "side": "current"},
    ]
    table = broker_cost.summary(runs)
    assert table["current"]["vs_baseline"]["transactions_per_request"] == pytest.approx(0.4)
    assert table["current"]["vs_baseline"]["broker_cpu_ms"] == pytest.approx(6.0 / 11.0)
    assert "vs_baseline" not in broker_cost.summary(runs[1:])["current"]
