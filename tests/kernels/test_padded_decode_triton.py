"""Padded decode steps (worker/engine/padded_decode.py) on the Triton kernels, under the
interpreter: a batch of 3 in bucket 4, then 2 and 1, gives the flat batches' tokens, through
DecodeGraphs with a fake capture too, the capture's forwards on padding rows write no K/V, and the
captured step has no device sync that goes through an op.
Runs tests/padded_decode_cases.py in a subprocess (TRITON_INTERPRET before triton is imported)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.kernels.test_warmup import CONFIG

ROOT = Path(__file__).resolve().parents[2]


def test_padded_decode_on_triton_equals_flat_batches(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "padded_decode_cases.py"), str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=1500,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    (result,) = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert result["backends"]["attention"] == "triton" and result["backends"]["fused_ops"] == "triton"
    assert result["buckets"] == [1, 2, 4] and result["captured"] == [4, 2, 1]
    assert result["kv_untouched"], "a padding row wrote K/V"
    assert result["padded"] == result["flat"] == result["graphs"], result
    assert [len(t) for t in result["flat"].values()] == [6, 4, 3]
    for steps in (result["padded_steps"], result["graph_steps"]):
        assert {(4, 3), (2, 2), (1, 1)} <= {tuple(s) for s in steps}, steps
    assert result["syncs"] == [], "the captured step syncs with the host: a CUDA graph capture would fail"
