"""The `inferline` CLI: each command as a subprocess against the real broker (and the scripted
stand-in worker of tests/kafka/test_client.py). Argument handling and bench statistics:
tests/unit/test_cli.py."""

from __future__ import annotations

import json
import os

import pytest

from inferline.producer.cli import (
    EXIT_REJECTED,
    EXIT_TIMEOUT,
)
from inferline.contract.schema import decode_cancel, encode_event
from tests.kafka.test_client import ScriptedWorker, error_script
from tests.unit.test_client import done, stream
from tests.unit.test_cli import REPO, run_cli  # noqa: F401


@pytest.fixture
async def cli_env(kafka_bootstrap, new_topic):
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERLINE_")}
    env.update(
        {
            "INFERLINE_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap,
            "INFERLINE_KAFKA__REQUEST_TOPIC": await new_topic(2, prefix="clireq"),
            "INFERLINE_KAFKA__CANCEL_TOPIC": await new_topic(1, prefix="clicancel"),
        }
    )
    return env


def mixed_script(req):
    if "code" in req.metadata:
        return error_script(req)
    return stream(req.id, [f"w{i} " for i in range(req.max_tokens)])


@pytest.mark.kafka
async def test_submit_streams_text(kafka_bootstrap, cli_env):
    async with ScriptedWorker(
        kafka_bootstrap, cli_env["INFERLINE_KAFKA__REQUEST_TOPIC"], mixed_script
    ) as worker:
        rc, out, err = await run_cli(
            cli_env, "submit", "hello there", "--max-tokens", "3", "--temperature", "0"
        )
        assert rc == 0, err
        assert out == "w0 w1 w2 \n"
        assert "stop" in err and "2+3 tokens" in err
        rc, out, err = await run_cli(
            cli_env,
            "submit",
            "-",
            "--system",
            "sys",
            "--max-tokens",
            "2",
            "--json",
            "--reply-topic",
            "per-request",
            "--regex",
            "(w[0-9] )+",
            "--top-logprobs",
            "2",
            stdin="from stdin",
        )
        assert rc == 0, err
        events = [json.loads(line) for line in out.splitlines()]
        assert [e["type"] for e in events] == ["started", "tokens", "tokens", "done"]
        assert events[-1]["text"] == "w0 w1 " and events[-1]["error"] is None
    first, second = worker.requests
    assert (first.prompt, first.max_tokens, first.temperature) == ("hello there", 3, 0.0)
    assert [m.content for m in second.messages] == ["sys", "from stdin"] and second.prompt is None
    assert (second.structured.regex, second.logprobs, second.top_logprobs) == (
        "(w[0-9] )+",
        True,
        2,
    )


@pytest.mark.kafka
async def test_submit_rejection_exit_code(kafka_bootstrap, cli_env):
    def script(req):
        return [done(req.id, 0, reason="rejected", error=("prompt_too_long", "way too long"))]

    async with ScriptedWorker(kafka_bootstrap, cli_env["INFERLINE_KAFKA__REQUEST_TOPIC"], script):
        rc, out, err = await run_cli(cli_env, "submit", "x")
    assert rc == EXIT_REJECTED and "prompt_too_long: way too long" in err


@pytest.mark.kafka
async def test_submit_client_timeout_exit_code(kafka_bootstrap, cli_env):
    # no worker at all: only the client's own limit ends the wait
    rc, _, err = await run_cli(cli_env, "submit", "nobody listens", "--client-timeout", "1")
    assert rc == EXIT_TIMEOUT and "client side" in err


@pytest.mark.kafka
async def test_cancel_command(kafka_bootstrap, cli_env):
    from tests.kafka_fixtures import consume_until

    rc, _, err = await run_cli(cli_env, "cancel", "req-42")
    assert rc == 0, err
    records = await consume_until(
        kafka_bootstrap, cli_env["INFERLINE_KAFKA__CANCEL_TOPIC"], lambda rs: rs, timeout=15
    )
    assert decode_cancel(records[0].value).id == "req-42" and records[0].key == b"req-42"


@pytest.mark.kafka
async def test_topics_create(kafka_bootstrap, cli_env):
    from aiokafka.admin import AIOKafkaAdminClient

    names = [f"test-topics-create-{os.getpid()}-{x}" for x in ("req", "cancel", "dlq")]
    env = {
        **cli_env,
        "INFERLINE_KAFKA__REQUEST_TOPIC": names[0],
        "INFERLINE_KAFKA__CANCEL_TOPIC": names[1],
        "INFERLINE_KAFKA__DLQ_TOPIC": names[2],
    }
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        rc, out, err = await run_cli(
            env, "topics", "create", "--partitions", "3", "--retention-ms", "120000"
        )
        assert rc == 0, err
        assert out.count("created") == 3
        described = {
            t["topic"]: len(t["partitions"])
            for t in await admin.describe_topics()
            if t["topic"] in names
        }
        assert described == {names[0]: 3, names[1]: 1, names[2]: 1}
        rc, out, _ = await run_cli(env, "topics", "create", "--partitions", "3")
        assert rc == 0 and out.count("exists") == 3
        # topic tenancy: each tenant's own request and cancel topic
        rc, out, err = await run_cli(
            env, "topics", "create", "--partitions", "2", "--tenant", "acme"
        )
        names += [f"{names[0]}.acme", f"{names[1]}.acme"]
        assert rc == 0 and out.count("created") == 2, err
        described = {
            t["topic"]: len(t["partitions"])
            for t in await admin.describe_topics()
            if t["topic"] in names
        }
        assert described[names[3]] == 2 and described[names[4]] == 1
        rc, _, err = await run_cli(env, "topics", "create", "--tenant", "a.b")
        assert rc != 0 and "must be 1-64 of" in err
        # reply topics made ahead, for clients and gateways that make none
        app = f"app-{os.getpid()}"
        rc, out, err = await run_cli(
            env, "topics", "create", "--tenant", "acme", "--reply-topic", app
        )
        names.append(f"inferline.reply.acme.{app}")
        assert rc == 0 and f"{names[-1]}: created (4 partitions" in out, err
        rc, _, err = await run_cli(env, "topics", "create", "--reply-topic", "a/b")
        assert rc != 0 and "'a/b': 1-64 of" in err
    finally:
        await admin.delete_topics(names)
        await admin.close()


@pytest.mark.kafka
async def test_tail(kafka_bootstrap, cli_env, new_topic):
    from tests.kafka_fixtures import produce_raw

    topic = await new_topic(2, prefix="tail")
    await produce_raw(
        kafka_bootstrap,
        topic,
        [(b"r", encode_event(e)) for e in stream("r", ["a", "b"])] + [b"junk"],
    )
    rc, out, err = await run_cli(cli_env, "tail", topic, "--from-beginning", "--idle-timeout", "3")
    assert rc == 0, err
    assert [line.split()[2] for line in out.splitlines()] == ["started", "tokens", "tokens", "done"]
    assert "undecodable" in err
    rc, out, _ = await run_cli(cli_env, "tail", topic, "--from-beginning", "--json", "--limit", "1")
    assert json.loads(out)["type"] == "started"


@pytest.mark.kafka
async def test_bench_writes_report_and_plots(kafka_bootstrap, cli_env, tmp_path):
    def script(req):  # two requests of the workload fail, the rest stream one token an event
        if req.max_tokens == 2:
            return [done(req.id, 0, reason="rejected", error=("overloaded", "busy"))]
        return stream(req.id, ["t"] * req.max_tokens)

    out_dir = tmp_path / "bench"
    async with ScriptedWorker(
        kafka_bootstrap, cli_env["INFERLINE_KAFKA__REQUEST_TOPIC"], script
    ) as worker:
        rc, out, err = await run_cli(
            cli_env,
            "bench",
            "-n",
            "12",
            "--prompt-len",
            "fixed:4",
            "--output-len",
            "uniform:2,6",
            "--rate",
            "50",
            "--out",
            str(out_dir),
            "--seed",
            "3",
        )
    n_rejected = sum(1 for r in worker.requests if r.max_tokens == 2)
    assert len(worker.requests) == 12 and n_rejected > 0  # seed 3 draws some 2s
    assert rc == 1  # not every request completed
    report = json.loads((out_dir / "bench.json").read_text())
    assert report["requests"] == 12 and report["completed"] == 12 - n_rejected
    assert report["errors"] == {"overloaded": n_rejected}
    # counted from done's usage (the scripted done always says 3), not from the events
    assert report["output_tokens"] == 3 * report["completed"]
    for key in ("ttft_s", "itl_s", "e2e_s", "queue_s"):
        assert report[key]["p50"] is not None and report[key]["p50"] <= report[key]["p99"]
    assert report["throughput_over_time"] and report["config"]["num_requests"] == 12
    assert (out_dir / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"
    assert (out_dir / "throughput.png").read_bytes()[:4] == b"\x89PNG"
    assert "TTFT" in out and "p99" in out and "req/s" in out
    assert all(
        r.temperature == 0 and r.ignore_eos and len(r.prompt_token_ids) == 4
        for r in worker.requests
    )


@pytest.mark.kafka
async def test_topics_take_their_replicas_from_the_settings_or_the_broker(kafka_bootstrap):
    """#51: no topic is made with a hard-coded replication factor of 1. On this one-broker
    cluster the broker's default is 1, so a factor of 2 from the settings reaching the broker shows
    as its refusal, and min.insync.replicas lands in the topic's configs."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    from inferline.producer.topics import create_topics, default_replication_factor

    topic = f"test-replicas-{os.getpid()}"
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        assert await default_replication_factor(admin) == 1  # scripts/kafka.sh's broker
        with pytest.raises(RuntimeError, match="error 38"):  # INVALID_REPLICATION_FACTOR
            await create_topics(admin, [(topic, 1)], replication_factor=2)
        assert await create_topics(admin, [(topic, 1)], min_insync_replicas=1) == [topic]
        resource = ConfigResource(ConfigResourceType.TOPIC, topic, {"min.insync.replicas": None})
        (response,) = await admin.describe_configs([resource])
        (entry,) = response.to_object()["resources"][0]["config_entries"]
        assert (entry["config_value"], entry["config_source"]) == ("1", 1)  # a topic config
    finally:
        await admin.delete_topics([topic])
        await admin.close()
