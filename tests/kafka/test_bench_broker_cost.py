"""Smoke test of the broker-cost benchmark (bench/broker_cost.py): this tree only, 10 requests on
the session's broker (its JVM found through scripts/kafka.sh's pid file).

It checks that the report's figures are there and sane, never their size: the figures come from
`python -m bench.broker_cost` (a private broker, a baseline tree beside this one).
"""

from __future__ import annotations

import json

import pytest

from bench import broker_cost

# A bench smoke run: `make test-full` (make test stays under its 20 minutes).
pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.full]

REQUESTS = 10


@pytest.fixture(scope="module")
def results(kafka_bootstrap, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-broker-cost") / "broker_cost.json"
    argv = ["--no-baseline", "--broker", "local", "--requests", str(REQUESTS), "--rate", "20"]
    argv += ["--warmup", "2", "--idle-s", "1", "--settle-s", "0", "--broker-warmup", "0"]
    argv += ["--out", str(out)]
    broker_cost.main(argv)
    return json.loads(out.read_text())


def test_one_run_of_this_tree_serves_every_request(results):
    assert {"command", "machine", "settings", "sides", "runs", "summary"} <= results.keys()
    assert list(results["sides"]) == ["current"]
    (run,) = results["runs"]
    assert run["side"] == "current" and run["worker_from_tree"]
    assert run["offered"] == run["served"] == REQUESTS and run["warmup_served"] == 2


def test_transactions_and_broker_cpu_per_request_are_sane(results):
    (run,) = results["runs"]
    assert run["transactions"].get("committed", 0) >= 1
    assert 0 < run["transactions_per_request"] <= 1  # at most one transaction per final
    if run["broker_cpu_s"] is None:
        pytest.skip("the broker's JVM is not this machine's (no pid file): no CPU figures")
    assert run["broker_cpu_ms_raw"] > 0 and run["worker_cpu_ms"] > 0
    assert run["broker_cpu_ms"] <= run["broker_cpu_ms_raw"]  # the idle broker's share is >= 0
    assert results["summary"]["current"]["broker_cpu_ms"] == run["broker_cpu_ms"]
