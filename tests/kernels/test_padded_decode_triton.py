"""Padded decode steps (worker/engine/padded_decode.py) on the Triton kernels, under the
interpreter: a batch of 3 in bucket 4, then 2 and 1, gives the flat batches' tokens, through
DecodeGraphs with a fake capture too (each step's split length rewritten in the same buffer, on
plans of several splits), the capture's forwards on padding rows write no K/V, and the captured
step has no device sync that goes through an op.
Runs tests/padded_decode_cases.py in a subprocess (TRITON_INTERPRET before triton is imported)."""

from __future__ import annotations

import json

import pytest

from tests.interpreted import run_cases
from tests.kernels.test_warmup import CONFIG


@pytest.mark.full  # ~55 s on the interpreter: make test-full (the suite's budget); make test runs
# padded decode on the CPU paths (tests/unit/test_padded_decode.py, test_overlap.py)
def test_padded_decode_on_triton_equals_flat_batches(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (result,) = run_cases("padded_decode_cases.py", str(tmp_path))
    assert (
        result["backends"]["attention"] == "triton" and result["backends"]["fused_ops"] == "triton"
    )
    assert result["buckets"] == [1, 2, 4] and result["captured"] == [4, 2, 1]
    assert result["kv_untouched"], "a padding row wrote K/V"
    assert result["padded"] == result["flat"] == result["graphs"], result
    assert [len(t) for t in result["flat"].values()] == [6, 4, 3]
    for steps in (result["padded_steps"], result["graph_steps"]):
        assert {(4, 3), (2, 2), (1, 1)} <= {tuple(s[:2]) for s in steps}, steps
        # the split length follows the step: several splits work on some, one on others
        working = {-(-longest // split_len) for _, _, longest, split_len in steps}
        assert 1 in working and max(working) >= 2, steps
    assert result["syncs"] == [], (
        "the captured step syncs with the host: a CUDA graph capture would fail"
    )
