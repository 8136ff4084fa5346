"""Quick run of the reply-topic metadata benchmark (bench/reply_topics.py): 600 reply topics, just
past MAX_PRODUCER_TOPICS, so that the worker's producers must prune their metadata (the aiokafka
publisher) or be renewed (the committer's librdkafka producer).

It checks what the producers keep, never a speed: the figures come from
`python -m bench.reply_topics` (10,000 topics). Runs its own private broker, not the shared one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from inferline.worker.delivery.commit import MAX_PRODUCER_TOPICS

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TOPICS = 600
# Topics a producer may track besides the reply topics of requests in flight (the warm-up topic,
# the dead-letter topic).
SPARE = 8


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-reply-topics") / "reply-topics.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.reply_topics", "--topics", str(TOPICS), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_writes_both_runs_and_every_event_arrives(results):
    assert {"command", "machine", "settings", "runs", "end_offsets"} <= results.keys()
    assert set(results["runs"]) == {"worker", "baseline"}
    for name, run in results["runs"].items():
        assert run["outcomes"] == {"ok": TOPICS}, name
        assert run["events"] == 3 * TOPICS and run["events_per_s"] > 0, name
    assert results["runs"]["worker"]["send_failures"] == 0
    ends = results["end_offsets"]
    assert ends["min"] >= ends["expected_min"]


def test_worker_producer_metadata_stays_bounded(results):
    md = results["runs"]["worker"]["publisher_producer"]
    # An empty topic set is not small: aiokafka then asks for every topic of the cluster.
    assert 0 < md["topics"] <= MAX_PRODUCER_TOPICS + SPARE, md
    assert md["cached_topics"] <= MAX_PRODUCER_TOPICS + SPARE, md


def test_the_committers_producer_is_renewed_past_the_bound(results):
    """librdkafka keeps a handle, and refreshes metadata, for every topic a producer wrote to:
    the committer's transactional producer is renewed instead of growing with every topic."""
    committer = results["runs"]["worker"]["committer_producer"]
    assert committer["topics"] <= MAX_PRODUCER_TOPICS + SPARE, committer
    assert committer["renewals"] >= 1 and committer["producers"] == 1 + committer["renewals"]


def test_plain_producer_keeps_every_topic(results):
    md = results["runs"]["baseline"]["producer"]
    assert md["topics"] == TOPICS + 1  # and the warm-up topic
    assert md["cached_topics"] == TOPICS + 1
