"""The light client: `pip install inferline` (no extra) into a fresh virtual environment brings
the client, the CLI and the gateway without torch, triton or transformers, and its `inferline`
runs a batch against a real worker. Needs PyPI (as `make install` does)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kafka.test_batch import chat_line, check_format, read_lines
from tests.unit.test_packaging import source_copy
from tests.worker_fixtures import start_worker, topics  # noqa: F401 - fixtures

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "triton", "transformers", "gguf", "accelerate", "xgrammar")


async def run(
    *argv: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 600
) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode, out.decode(errors="replace")


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory) -> Path:
    """A fresh venv with `pip install <the project>`, no extras."""
    tmp = tmp_path_factory.mktemp("light")
    src, venv = source_copy(tmp / "src"), tmp / "venv"

    for argv in (
        [sys.executable, "-m", "venv", str(venv)],
        [
            str(venv / "bin" / "pip"),
            "install",
            "-q",
            "--disable-pip-version-check",
            "-c",
            str(REPO / "constraints.txt"),
            str(src),
        ],
    ):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout + done.stderr
    return venv


async def test_the_client_installs_without_the_inference_stack(light_venv):
    python = str(light_venv / "bin" / "python")
    rc, out = await run(
        python,
        "-c",
        "import importlib.util as u, json; "
        f"print(json.dumps([m for m in {HEAVY!r} if u.find_spec(m)]))",
    )
    assert rc == 0 and json.loads(out) == [], out
    rc, out = await run(str(light_venv / "bin" / "inferline"), "--help", cwd=light_venv)
    assert rc == 0 and "batch" in out and "gateway" in out, out
    # The gateway's app builds (FastAPI, uvicorn) and so does the client API.
    rc, out = await run(
        python,
        "-c",
        "from inferline.producer.gateway.app import create_app; create_app(); "
        "from inferline.producer.client import InferenceClient; print('ok')",
        cwd=light_venv,
    )
    assert rc == 0 and out.strip().endswith("ok"), out
    rc, out = await run(str(light_venv / "bin" / "inferline-worker"), cwd=light_venv)
    assert rc != 0 and "torch" in out  # the worker needs the `worker` extra


async def test_the_light_client_runs_a_batch(
    light_venv, kafka_bootstrap, topics, start_worker, tmp_path
):
    await start_worker(topics)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(chat_line(f"c{i}", f"Say {i}.") + "\n" for i in range(4)))
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("INFERLINE_") and k != "PYTHONPATH"
    }
    env.update(
        {
            "INFERLINE_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap,
            "INFERLINE_KAFKA__REQUEST_TOPIC": topics.requests,
            "INFERLINE_KAFKA__CANCEL_TOPIC": topics.cancel,
        }
    )
    rc, out = await run(
        str(light_venv / "bin" / "inferline"),
        "batch",
        "run",
        str(src),
        "-o",
        str(dst),
        "--no-progress",
        env=env,
        cwd=tmp_path,
    )
    assert rc == 0, out
    outs = read_lines(dst)
    assert sorted(o["custom_id"] for o in outs) == ["c0", "c1", "c2", "c3"]
    for o in outs:
        check_format(o)
        assert o["response"]["status_code"] == 200
