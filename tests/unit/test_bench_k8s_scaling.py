"""bench/k8s_scaling.py's quick run: both signals replayed on the same arrivals, every request
finished, and the model's verdict that Kafka's lag over-scales under mixed lengths (issue 51).
It checks the simulation's outputs, never a speed; the figures come from the full run."""

from __future__ import annotations

import json

from bench import k8s_scaling


def test_the_quick_replay_writes_both_signals(tmp_path):
    out = tmp_path / "k8s.json"
    assert k8s_scaling.main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"backlog", "lag"} and report["requests"] > 1_000
    for run in report["runs"].values():
        assert run["unfinished"] == 0 and 0 < run["ttft_p50_s"] <= run["ttft_p99_s"]
    backlog, lag = report["runs"]["backlog"], report["runs"]["lag"]
    assert lag["worker_hours"] > backlog["worker_hours"]  # finished records above a long one


def test_kafkas_lag_counts_finished_records_above_an_unfinished_one():
    load = k8s_scaling.Load(hours=0.01, partitions=1)
    reqs = k8s_scaling.Requests.of(load)
    fleet = k8s_scaling.Fleet(reqs, load, k8s_scaling.Policy())
    n = len(reqs.arrival)
    fleet.finished[1:] = True  # everything but the first record of the one partition
    assert fleet.signal("backlog", n) == 1 and fleet.signal("lag", n) == n
    fleet.finished[0] = True
    assert fleet.signal("backlog", n) == 0 and fleet.signal("lag", n) == 0
