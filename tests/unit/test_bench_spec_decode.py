"""Smoke test of bench/spec_decode.py (plain vs n-gram drafts, ABBA): it runs, counts and reports;
no times asserted. Greedy tokens must agree for every request: drafts never change them."""
from __future__ import annotations

import pytest

from bench import spec_decode


@pytest.mark.full
def test_both_ways_run_every_request_twice_with_the_same_tokens(capsys):
    res = spec_decode.main(["--num-requests", "3", "--max-output", "12", "--threads", "1", "--single", "2",
                            "--lookup-min", "1"])
    batch = res["batch"]
    assert [len(batch["runs"][m]) for m in ("none", "ngram")] == [2, 2]
    runs = batch["runs"]["none"] + batch["runs"]["ngram"]
    assert all(r["complete"] for r in runs) and len({r["useful_tokens"] for r in runs}) == 1
    assert batch["same_greedy"] == batch["num_requests"] == 3
    assert all(r["spec_draft_tokens"] > 0 for r in batch["runs"]["ngram"])
    assert all(r["spec_draft_tokens"] == 0 for r in batch["runs"]["none"])
    assert res["single"]["same_greedy"] == res["single"]["num_requests"] == 2
    out = capsys.readouterr().out
    assert "ngram / none" in out and "one request at a time" in out
