"""The command line's handling of a bad setting: exit 2 with one line."""

import os
import subprocess
import sys


from tests.worker_fixtures import REPO, collect, request, start_worker, submit, topics  # noqa: F401


def test_bad_setting_exits_2_with_one_line():
    env = {**os.environ, "INFERLINE_SCHEDULER__MAX_NUM_SEQS": "zero"}
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "inferline.worker"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "INFERLINE_SCHEDULER__MAX_NUM_SEQS" in lines[0], proc.stderr
