"""`inferline batch run` against the real broker and a real worker: OpenAI's batch output, bad
lines, duplicate custom_ids, and a 200-line batch whose worker is SIGKILLed and restarted and
whose CLI is interrupted (SIGINT) and resumed: every line answered exactly once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from inferline.contract.schema import DoneEvent, decode_event, decode_request
from tests.kafka_fixtures import consume_until
from tests.unit.test_cli import REPO, run_cli
from tests.worker_fixtures import (  # noqa: F401 - fixtures
    PROMPTS,
    spawn_worker,
    start_worker,
    topics,
    wait_log,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def chat_line(custom_id: str, prompt: str, max_tokens: int = 6, **body) -> str:
    return json.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 0,
                **body,
            },
        }
    )


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_format(out: dict) -> None:
    """One output line in OpenAI's batch output format."""
    assert set(out) == {"id", "custom_id", "response", "error"}, out
    assert out["id"].startswith("batch_req_")
    if out["response"] is None:
        assert set(out["error"]) == {"code", "message"}
        return
    assert out["error"] is None and set(out["response"]) == {"status_code", "request_id", "body"}
    body = out["response"]["body"]
    if out["response"]["status_code"] != 200:
        assert set(body["error"]) == {"message", "type", "param", "code"}
    elif body["object"] == "chat.completion":
        assert ChatCompletion.model_validate(body).choices[0].message.content is not None
    else:
        assert Completion.model_validate(body).choices[0].text is not None


@pytest.fixture
def batch_env(kafka_bootstrap, topics):
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERLINE_")}
    env.update(
        {
            "INFERLINE_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap,
            "INFERLINE_KAFKA__REQUEST_TOPIC": topics.requests,
            "INFERLINE_KAFKA__CANCEL_TOPIC": topics.cancel,
        }
    )
    return env


async def test_batch_run_answers_every_line_once(
    kafka_bootstrap, topics, start_worker, batch_env, tmp_path
):
    await start_worker(topics)
    lines = [chat_line(f"q{i}", PROMPTS[i % len(PROMPTS)]) for i in range(6)]
    lines.append(
        json.dumps(
            {
                "custom_id": "legacy",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0},
            }
        )
    )
    lines.append(
        json.dumps(
            {
                "custom_id": "samples",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 3,
                    "n": 2,
                    "seed": 7,
                    "logprobs": True,
                    "top_logprobs": 2,
                },
            }
        )
    )
    lines += [
        "{oops",
        chat_line("bad-temp", "x", temperature=-1),
        json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")

    rc, _, err = await run_cli(batch_env, "batch", "run", str(src), "-o", str(dst), "--no-progress")
    assert rc == 1, err  # three bad lines
    outs = read_lines(dst)
    assert len(outs) == len(lines), err
    for out in outs:
        check_format(out)
    by_key = {o["custom_id"]: o for o in outs}
    assert by_key[None]["error"]["message"].startswith("line 9: not valid JSON")
    assert (
        by_key["bad-temp"]["error"]["message"]
        == "line 10: body.temperature: Input should be greater than or equal to 0"
    )
    assert by_key["bad-url"]["error"]["message"].startswith("line 11: url: must be")
    answer = by_key["q1"]["response"]
    assert answer["status_code"] == 200 and answer["body"]["usage"]["completion_tokens"] == 6
    assert (
        answer["body"]["model"] == "SmolLM2-135M-Instruct"
        and answer["body"]["id"] == f"chatcmpl-{answer['request_id']}"
    )
    assert by_key["legacy"]["response"]["body"]["object"] == "text_completion"
    samples = by_key["samples"]["response"]["body"]["choices"]
    assert [c["index"] for c in samples] == [0, 1] and len(samples[0]["logprobs"]["content"]) == 3
    assert not (tmp_path / "out.jsonl.state").exists()  # done: nothing left to resume
    # Same ids every run: the request id is the batch's and the line's.
    assert (
        answer["request_id"].startswith("batch_")
        and len({o["response"]["request_id"] for o in outs if o["response"]}) == 8
    )

    rc, _, err = await run_cli(batch_env, "batch", "run", str(src), "-o", str(dst), "--no-progress")
    assert rc == 1 and "0 to do" in err and len(read_lines(dst)) == len(lines)

    dup = tmp_path / "dup.jsonl"
    dup.write_text(
        "\n".join([chat_line("a", "x"), chat_line("b", "y"), chat_line("a", "z")]) + "\n"
    )
    rc, _, err = await run_cli(
        batch_env, "batch", "run", str(dup), "-o", str(tmp_path / "dup.out"), "--no-progress"
    )
    assert rc == 2 and "duplicate custom_id: 'a' on lines 1, 3" in err
    assert not (tmp_path / "dup.out").exists()


async def drop_topic(bootstrap: str, topic: str) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([topic])
    finally:
        await admin.close()


async def start_cli(env: dict, *argv: str) -> asyncio.subprocess.Process:
    # A suite started in the background by a shell without job control ignores SIGINT, and so
    # would the CLI (its Ctrl-C is what the test sends): it gets the default back.
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-P",
        "-m",
        "inferline.producer",
        *argv,
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=_default_sigint,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def wait_lines(
    path: Path, n: int, proc: asyncio.subprocess.Process, timeout: float = 300.0
) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() or path.read_text().count("\n") < n:
        assert proc.returncode is None, (
            f"the CLI exited {proc.returncode}: {(await proc.stderr.read()).decode()}"
        )
        assert time.monotonic() < deadline, f"fewer than {n} lines in {path} after {timeout} s"
        await asyncio.sleep(0.2)


@pytest.mark.full  # `make chaos` runs it: kills and restarts, a minute or more
@pytest.mark.chaos
async def test_batch_survives_worker_kill_and_cli_interrupt(
    kafka_bootstrap, topics, batch_env, tmp_path
):
    """200 lines: the worker is SIGKILLed and restarted, the CLI is interrupted and run again;
    every line ends with exactly one output line, and nothing an earlier run got back is sent
    again."""
    n = 200
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(
        "\n".join(
            chat_line(f"line-{i}", f"{PROMPTS[i % len(PROMPTS)]} ({i})", max_tokens=4 + i % 5)
            for i in range(n)
        )
        + "\n"
    )
    cfg = {
        "kafka": {"group_id": f"g-{uuid.uuid4().hex[:8]}", "group_instance_id": "batch-kill"},
        "scheduler": {"max_num_seqs": 16, "max_waiting": 64},
    }
    log = tmp_path / "worker.log"
    worker = spawn_worker(kafka_bootstrap, topics, log, **cfg)
    argv = (
        "batch",
        "run",
        str(src),
        "-o",
        str(dst),
        "--no-progress",
        "--max-in-flight",
        "24",
        "--keep",
    )
    try:
        await wait_log(log, "intake.assigned", worker)
        cli = await start_cli(batch_env, *argv)
        await wait_lines(dst, 40, cli)
        worker.kill()
        worker.wait()
        worker = spawn_worker(kafka_bootstrap, topics, log, **cfg)
        await wait_lines(dst, 100, cli)
        cli.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(cli.communicate(), 60)
        assert cli.returncode == 130, err.decode()
        assert "interrupted" in err.decode()
        partial = read_lines(dst)  # valid: every line whole
        assert len({o["custom_id"] for o in partial}) == len(partial) < n
        state = (tmp_path / "out.jsonl.state").read_text().splitlines()
        batch_id = json.loads(state[0])["batch_id"]

        rc, _, err = await run_cli(batch_env, *argv, timeout=600)
        assert rc == 0, err
    finally:
        worker.kill()
        worker.wait()
    outs = read_lines(dst)
    assert sorted(o["custom_id"] for o in outs) == sorted(f"line-{i}" for i in range(n))
    for out in outs:
        check_format(out)
        assert out["response"]["status_code"] == 200, out
    assert outs[: len(partial)] == partial  # the resumed run only appended
    found = int(err.split("(")[1].split(" answered by an earlier run")[0])
    followed = int(err.split("earlier run, ")[1].split(" sent by one")[0])
    # In flight at the interrupt: answered meanwhile (found) or still running (awaited), never
    # sent again.
    assert found + followed >= 1, err

    # Every request id on the request topic is a line's; a line sent twice (a send cut by the
    # interrupt) still has one output line, checked above.
    records = await consume_until(kafka_bootstrap, topics.requests, timeout=60)
    sent = [decode_request(r.value).id for r in records]
    ids = {o["response"]["request_id"] for o in outs}
    assert set(sent) == ids and all(i.startswith(batch_id) for i in ids)
    reply_topic = f"inferline.reply.batch-{batch_id}"
    replies = await consume_until(kafka_bootstrap, reply_topic, timeout=60)
    await drop_topic(kafka_bootstrap, reply_topic)  # --keep kept it
    finals = {}
    for r in replies:
        ev = decode_event(r.value)
        if isinstance(ev, DoneEvent) and ev.finish_reason != "requeued":
            finals.setdefault(ev.id, []).append(ev)
    assert set(finals) == ids
    print(
        f"sent {len(sent)} requests for {n} lines; resumed run: {found} found, {followed} awaited"
    )
