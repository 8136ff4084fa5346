"""Smoke tests of bench/ab.py (ABBA runs of one workload): each experiment runs every request
twice each way, counts and reports; no times asserted."""

from __future__ import annotations

import pytest

from bench import ab


@pytest.mark.full
def test_kv_dtype_runs_both_caches_twice(capsys):
    res = ab.main(["kv-dtype", "--num-requests", "3", "--max-output", "6", "--threads", "1"])
    assert [len(res["runs"][d]) for d in ("auto", "float16")] == [2, 2]
    for runs in res["runs"].values():
        assert all(r["complete"] and r["useful_tokens"] == 3 * 6 for r in runs)
    assert 0 <= res["same_greedy"] <= res["num_requests"] == 3 and res["ratio"] > 0
    assert "float16 / auto" in capsys.readouterr().out


@pytest.mark.full
def test_spec_decode_drafts_and_never_changes_greedy_tokens(capsys):
    """One seat: the requests one at a time, single-stream decoding."""
    res = ab.main(
        [
            "spec-decode",
            "--num-requests",
            "3",
            "--max-output",
            "12",
            "--threads",
            "1",
            "--seats",
            "1",
            "--lookup-min",
            "1",
        ]
    )
    runs = res["runs"]["none"] + res["runs"]["ngram"]
    assert all(r["complete"] and r["mean_batch_size"] == 1 for r in runs)
    assert len({r["useful_tokens"] for r in runs}) == 1
    assert res["same_greedy"] == res["num_requests"] == 3
    assert all(r["spec_draft_tokens"] > 0 for r in res["runs"]["ngram"])
    assert all(r["spec_draft_tokens"] == 0 for r in res["runs"]["none"])
    assert "ngram / none" in capsys.readouterr().out


def test_static_policy_defaults_to_hfs_batch():
    assert ab.parse_args(["kv-dtype", "--policy", "static"]).seats == 16
    assert ab.parse_args(["spec-decode"]).seats == 64
    with pytest.raises(SystemExit):
        ab.parse_args(["fp8"])
