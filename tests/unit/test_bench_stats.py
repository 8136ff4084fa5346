"""bench/stats.py, the benchmarks' one stats helper: percentiles, a run summed up, runs compared
against a baseline, the ABBA order."""

from __future__ import annotations

import pytest

from bench import stats
from bench.stats import Timed


def test_percentiles_interpolate_and_a_run_sums_its_requests():
    assert stats.pct([3, 1, 2, 4], 50) == 2.5 and stats.pct([], 50) is None
    timed = [Timed(0.0, 0.5, 2.0, 8), Timed(1.0, 1.2, 4.0, 8), Timed(1.0, None, 1.5, 0, ok=False)]
    s = stats.summarize(timed, 24)
    assert (s["requests"], s["completed"], s["useful_tokens"], s["wall_s"]) == (3, 2, 16, 4.0)
    assert s["tokens_per_s"] == 4.0 and not s["complete"]
    assert s["ttft_s"]["p50"] == pytest.approx(0.35) and s["ttft_s"]["n"] == 2
    assert stats.summarize(timed[:2], 16)["complete"]


def test_compare_takes_medians_per_path_against_the_baseline():
    def run(path, tps, p50, complete=True):
        return {
            "path": path,
            "tokens_per_s": tps,
            "ttft_s": {"p50": p50, "p99": 2 * p50},
            "complete": complete,
        }

    table = stats.compare(
        [
            run("base", 100, 1.0),
            run("new", 200, 0.2),
            run("new", 180, 0.4),
            run("base", 120, 1.2),
            run("new", 300, 0.1, complete=False),
        ],
        "base",
    )
    assert table["base"]["tokens_per_s"] == 110 and table["base"]["runs"] == 2
    new = table["new"]
    assert new["tokens_per_s"] == 200 and new["ttft_p50_s"] == 0.2 and not new["complete"]
    assert new["vs_baseline"]["tokens_per_s"] == pytest.approx(200 / 110)
    assert new["vs_baseline"]["ttft_p50_diff_ms"] == pytest.approx(-900)
    assert new["vs_baseline"]["ttft_p99"] == pytest.approx(0.4 / 2.2)
    assert "vs_baseline" not in table["base"]
    assert "vs_baseline" not in stats.compare([run("new", 5, 1)], "base")["new"]


def test_runs_alternate_abba():
    assert stats.abba(["l", "a", "c"], 2) == ["l", "a", "c", "c", "a", "l"]
