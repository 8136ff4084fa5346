"""Smoke test of bench/load_thread.py: both modes run in processes of their own and report a
step time. Never a speed: which mode is faster is measured by the benchmark, not asserted."""
from __future__ import annotations

import pytest

from bench import load_thread


@pytest.mark.full
def test_both_modes_report_a_step_time(capsys):
    results = load_thread.main(["--repeats", "1", "--steps", "2", "--batch", "2", "--threads", "1"])
    assert set(results) == set(load_thread.MODES)
    assert all(len(times) == 1 and times[0] > 0 for times in results.values())
    assert "built on the stepping thread" in capsys.readouterr().out
