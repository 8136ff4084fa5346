"""bench/k8s_scaling.py: the simulation's parts (the assignors, the HPA's limits, the worker model)
and a one-hour run; and its policy is the chart's (values.yaml). No times asserted."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml

from bench import k8s_scaling as ks

VALUES = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "inferline" / "values.yaml"


def test_the_simulated_policy_is_the_charts():
    a = yaml.safe_load(VALUES.read_text())["autoscaling"]
    p = ks.Policy()
    assert (p.lag_threshold, p.util_target, p.min_replicas) == \
        (a["kafka"]["lagThreshold"], a["utilization"]["target"], a["minReplicas"])
    up, down = a["behavior"]["scaleUp"], a["behavior"]["scaleDown"]
    assert (p.up_percent, p.up_pods, p.up_period_s) == (up["percent"], up["pods"], up["periodSeconds"])
    assert (p.down_window_s, p.down_pods, p.down_period_s) == \
        (down["stabilizationWindowSeconds"], down["pods"], down["periodSeconds"])
    assert p.metric_window_s == 60 and a["utilization"]["window"] == "1m"


def test_the_worker_model_goes_through_its_measured_points():
    w = ks.Worker()
    full = np.array(float(w.seats))
    assert abs(w.seats / w.service_s(full) * ks.MEAN_OUTPUT_TOKENS - ks.SATURATED_TOKENS_PER_S) < 1e-6
    assert abs(float(w.engine_ttft(np.array(0.0))) - ks.TTFT_IDLE_S) < 1e-9
    rho, ttft = ks.TTFT_POINT
    assert abs(float(w.engine_ttft(np.array(rho))) - ttft) < 1e-9


def test_round_robin_and_sticky_assignments():
    assert ks.round_robin(6, [7, 9]).tolist() == [7, 9, 7, 9, 7, 9]
    owner = ks.round_robin(12, [0, 1, 2])
    grown = ks.sticky(owner, [0, 1, 2, 3])
    assert sorted(np.bincount(grown).tolist()) == [3, 3, 3, 3]
    assert (grown != owner).sum() == 3          # only the new member's share moves
    shrunk = ks.sticky(owner, [0, 1])
    assert (shrunk != owner).sum() == 4 and sorted(np.bincount(shrunk).tolist()) == [6, 6]


def test_the_hpa_limits_and_the_stabilization_window():
    p = ks.Policy(min_replicas=1, max_replicas=48, lag_threshold=10, util_target=1e9)
    hpa = ks.Autoscaler(p, partitions=48)
    assert hpa.decide(0, lag=1000, current=2) == 6        # max(2 x 2, 2 + 4) per 60 s
    assert hpa.decide(15, lag=1000, current=6) == 6       # the period's budget is spent
    assert hpa.decide(61, lag=1000, current=6) == 12      # a new period: 2 x 6
    # Demand falls: nothing for the window, then one pod per period.
    t = 61
    while t < 61 + p.down_window_s - 15:
        t += 15
        assert hpa.decide(t, lag=10, current=12) == 12
    assert hpa.decide(61 + p.down_window_s + 15, lag=10, current=12) == 11
    assert hpa.decide(61 + p.down_window_s + 30, lag=10, current=11) == 11


def test_an_hour(tmp_path, capsys):
    out = ks.main(["--quick", "--out-dir", str(tmp_path)])
    runs = out["runs"]
    fixed = [r for name, r in runs.items() if name.startswith("fixed")]
    assert len(fixed) == 2 and all(r["requeued"] == 0 and r["rebalances"] == 1 for r in fixed)
    for name, r in runs.items():
        assert r["requests"] > 0 and r["worker_hours"] > 0, name
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] <= r["ttft_p999_s"], name
    chart, incremental = runs["chart defaults"], runs["chart, incremental rebalance"]
    assert chart["rebalances"] > 1
    assert incremental["requeued"] < chart["requeued"]   # sticky moves requeue less than eager ones
    assert json.loads((tmp_path / "k8s_scaling.json").read_text())["runs"].keys() == runs.keys()
    assert (tmp_path / "k8s_scaling.png").stat().st_size > 0
    assert "chart defaults" in capsys.readouterr().out
