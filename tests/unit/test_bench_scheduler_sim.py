"""bench/scheduler_sim.py: the real Scheduler under a step-cost model."""

from __future__ import annotations

import pytest

from bench.scheduler_sim import Load, compare, run
from inferline.worker.engine.scheduler import BackgroundLimit

COST = (30.0, 4.5, 4.0)


def test_a_lone_request_on_an_idle_engine_gets_its_first_token_after_its_prompt_step():
    load = Load(rate=0.1, interactive=3, interactive_prompt=30, interactive_tokens=4)
    r = run(load, COST, None, interactive=True, batch=False)
    assert r["ttft_p50_ms"] == pytest.approx(30.0 + 30 * 4.0)  # fixed + the prompt's tokens
    assert 0 < r["busy_share"] < 0.2


def test_the_background_limit_trades_batch_throughput_for_interactive_latency():
    load = Load(rate=2.0, interactive=150, batch_lines=200)
    off = compare(load, COST, None)
    on = compare(load, COST, BackgroundLimit(100, 16))
    assert (
        on["ttft_p50_ratio"] < off["ttft_p50_ratio"]
        and on["ttft_p99_ratio"] < off["ttft_p99_ratio"]
    )
    assert 0 < on["batch_beside"] < off["batch_beside"]
    assert on["batch_alone"] == off["batch_alone"] > 0
