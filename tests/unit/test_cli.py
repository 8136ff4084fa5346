"""The `inferline` CLI without a broker: argument handling, workloads and bench statistics. Each
command against the real broker: tests/kafka/test_cli.py."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
from pathlib import Path

import pytest

from inferline.producer.cli import (
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_TIMEOUT,
    Length,
    Sample,
    build_parser,
    distribution,
    exit_code,
    format_event,
    inter_token_latencies,
    load_dataset,
    make_workload,
    percentile,
    prompt_fields,
    sampling_params,
    summarize,
    throughput_series,
)
from inferline.producer.client import ClientTimeout, PromptTooLong, RequestCancelled, WorkerError
from inferline.contract.schema import Request
from tests.unit.test_client import done, started, tokens

REPO = Path(__file__).resolve().parents[2]

# --------------------------------------------------------------------------- arguments


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_submit_flags_become_request_fields():
    args = parse(
        "submit",
        "hi",
        "--max-tokens",
        "5",
        "--temperature",
        "0",
        "--top-p",
        "0.9",
        "--seed",
        "7",
        "--stop",
        "\n",
        "--stop",
        "END",
        "--priority",
        "-1",
        "--timeout",
        "30",
        "--no-stream",
    )
    assert sampling_params(args) == {
        "max_tokens": 5,
        "temperature": 0.0,
        "top_p": 0.9,
        "seed": 7,
        "stop": ["\n", "END"],
        "priority": -1,
        "stream": False,
        "timeout_s": 30.0,
    }
    assert prompt_fields(args) == {"prompt": "hi"}


def test_output_constraints_become_request_fields_the_contract_accepts(tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string"}}}))
    grammar = tmp_path / "yn.ebnf"
    grammar.write_text('root ::= "yes" | "no"')
    cases = {
        ("--json-schema", str(schema)): {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "person",
                    "schema": {"type": "object", "properties": {"name": {"type": "string"}}},
                    "strict": True,
                },
            }
        },
        ("--json-object",): {"response_format": {"type": "json_object"}},
        ("--regex", "[0-9]+"): {"structured": {"regex": "[0-9]+"}},
        ("--choice", "yes", "--choice", "no"): {"structured": {"choice": ["yes", "no"]}},
        ("--grammar", str(grammar)): {"structured": {"grammar": 'root ::= "yes" | "no"'}},
        ("--logprobs",): {"logprobs": True},
        ("--top-logprobs", "3"): {"logprobs": True, "top_logprobs": 3},
    }
    for flags, fields in cases.items():
        assert sampling_params(parse("submit", "hi", *flags)) == fields, flags
        Request(
            id="r", reply_topic="inferline.reply.x", prompt="hi", **fields
        )  # the contract takes them


def test_one_output_constraint_at_a_time(capsys):
    with pytest.raises(SystemExit):
        parse("submit", "hi", "--regex", "a", "--choice", "b")
    assert "not allowed with argument" in capsys.readouterr().err


def test_unset_flags_keep_contract_defaults():
    assert sampling_params(parse("submit", "hi")) == {}


def test_chat_system_and_stdin():
    args = parse("submit", "-", "--system", "be brief")
    assert prompt_fields(args, stdin=io.StringIO("question")) == {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "question"},
        ]
    }
    assert prompt_fields(parse("submit", "q", "--chat")) == {
        "messages": [{"role": "user", "content": "q"}]
    }


def test_global_options_and_subcommands():
    args = parse("--bootstrap-servers", "b:1", "--request-topic", "rq", "cancel", "abc")
    assert (args.bootstrap_servers, args.request_topic, args.command, args.id) == (
        "b:1",
        "rq",
        "cancel",
        "abc",
    )
    assert parse("topics", "create", "--partitions", "3").partitions == 3
    assert parse("tail", "t", "--limit", "2").limit == 2
    with pytest.raises(SystemExit):
        parse("frobnicate")


def test_exit_codes():
    assert exit_code(None) == EXIT_OK
    assert exit_code(PromptTooLong("x")) == EXIT_REJECTED
    assert exit_code(ClientTimeout("x")) == EXIT_TIMEOUT
    assert exit_code(RequestCancelled("x")) == 5 and exit_code(WorkerError("x")) == 1


# ------------------------------------------------------------------------- bench workload and stats


@pytest.mark.parametrize(
    "spec,low,high", [("fixed:8", 8, 8), ("uniform:8,256", 8, 256), ("uniform:1,1", 1, 1)]
)
def test_length_parse(spec, low, high):
    assert Length.parse(spec) == Length(low, high)


@pytest.mark.parametrize("spec", ["fixed:0", "uniform:5,4", "normal:3", "uniform:3", "fixed:x", ""])
def test_length_parse_rejects(spec):
    with pytest.raises(argparse.ArgumentTypeError):
        Length.parse(spec)


def test_bad_length_exits_before_connecting():
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-P", "-m", "inferline.producer", "bench", "--output-len", "uniform:9,2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "bad length" in proc.stderr


def test_workload_is_reproducible_and_within_bounds():
    args = parse(
        "bench",
        "-n",
        "50",
        "--prompt-len",
        "uniform:3,9",
        "--output-len",
        "uniform:8,256",
        "--seed",
        "4",
    )
    w1, w2 = make_workload(args), make_workload(args)
    assert w1 == w2 and len(w1) == 50
    assert all(3 <= len(f["prompt_token_ids"]) <= 9 and 8 <= f["max_tokens"] <= 256 for f in w1)
    assert all(f["temperature"] == 0.0 and f["ignore_eos"] is True for f in w1)
    assert len({f["max_tokens"] for f in w1}) > 10


def test_dataset_workload(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(
        '{"prompt": "a", "output_len": 4, "extra": 1}\n\n'
        '{"prompt_token_ids": [1, 2], "max_tokens": 3}\n'
    )
    assert load_dataset(str(path)) == [
        {"prompt": "a", "max_tokens": 4},
        {"prompt_token_ids": [1, 2], "max_tokens": 3},
    ]
    work = make_workload(parse("bench", "-n", "3", "--dataset", str(path)))
    assert [w.get("prompt") for w in work] == ["a", None, "a"]


def test_percentile_matches_linear_interpolation():
    xs = list(range(1, 11))
    assert percentile(xs, 50) == 5.5
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(xs, 99) == pytest.approx(9.91)
    assert percentile(xs, 0) == 1 and percentile(xs, 100) == 10
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None
    assert percentile([5, 1, 3], 50) == 3  # unsorted input


def test_inter_token_latency_spreads_coalesced_tokens():
    assert inter_token_latencies([(0.0, 1), (0.3, 3), (0.5, 1)]) == pytest.approx(
        [0.1, 0.1, 0.1, 0.2]
    )
    assert inter_token_latencies([(0.0, 4)]) == []


def sample(ok=True, code=None, ttft=0.1, e2e=1.0, tokens=10, times=((0.0, 1), (0.5, 9))) -> Sample:
    return Sample(
        ok=ok,
        code=code,
        ttft_s=ttft,
        e2e_s=e2e,
        queue_s=0.01,
        output_tokens=tokens,
        itl=inter_token_latencies(list(times)),
        token_times=list(times),
        attempts=1,
    )


def test_summary():
    samples = [
        sample(),
        sample(ttft=0.3, e2e=2.0),
        sample(ok=False, code="overloaded", tokens=0, times=()),
        sample(ok=False, code="timeout", tokens=0, times=()),
    ]
    report = summarize(samples, wall_s=2.0)
    assert report["completed"] == 2 and report["errors"] == {"overloaded": 1, "timeout": 1}
    assert report["requests_per_s"] == 1.0 and report["output_tokens_per_s"] == 10.0
    assert report["ttft_s"]["p50"] == pytest.approx(0.2) and report["e2e_s"]["max"] == 2.0
    assert distribution([])["p50"] is None


def test_throughput_series():
    s = [sample(times=((10.0, 1), (10.5, 4), (12.2, 5)))]
    assert throughput_series(s, t0=10.0) == [(0.0, 5.0), (1.0, 0.0), (2.0, 5.0)]


def test_format_event():
    assert format_event(tokens("r", "hi", 3, ids=[7, 8])) == "r a1#3 tokens 2 tok 'hi'"
    assert "rejected" in format_event(done("r", 1, reason="rejected", error=("overloaded", "busy")))
    assert "overloaded: busy" in format_event(
        done("r", 1, reason="rejected", error=("overloaded", "busy"))
    )
    assert format_event(started("r")).startswith("r a1#0 started worker=w")


# --------------------------------------------------------------------------- commands through Kafka


async def run_cli(
    env: dict[str, str], *argv: str, stdin: str | None = None, timeout: float = 120
) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-P",
        "-m",
        "inferline.producer",
        *argv,
        cwd=REPO,
        env=env,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin else None), timeout)
    return proc.returncode, out.decode(), err.decode()


async def test_topics_acls_prints_the_recipe():
    """`inferline topics acls`: topic tenancy's ACLs as kafka-acls.sh commands (the rule set that
    tests/kafka/test_acl_tenancy.py applies to a broker with an authorizer)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERLINE_")}
    env.update(INFERLINE_KAFKA__BOOTSTRAP_SERVERS="broker:9092")
    rc, out, err = await run_cli(
        env, "topics", "acls", "--tenant", "acme", "--worker-principal", "User:w"
    )
    assert rc == 0, err
    lines = out.splitlines()
    assert (
        "kafka-acls.sh --bootstrap-server broker:9092 --add --allow-principal User:acme "
        "--operation Write --topic llm.requests.acme"
    ) in lines
    assert (
        "kafka-acls.sh --bootstrap-server broker:9092 --add --allow-principal User:acme "
        "--operation Read --topic inferline.reply.acme. --resource-pattern-type prefixed"
    ) in lines
    assert not [
        ln
        for ln in lines
        if "User:acme" in ln and "llm.requests." in ln and "acme" not in ln.split()[-1]
    ]
    assert sum("User:w " in ln for ln in lines) == 8
    assert (
        "kafka-acls.sh --bootstrap-server broker:9092 --add --allow-principal User:w "
        "--operation Write --transactional-id inferline-workers. --resource-pattern-type prefixed"
    ) in lines
    creates = "--operation Create --topic inferline.reply.acme. --resource-pattern-type prefixed"
    assert any(creates in ln for ln in lines)
    # Reply topics made ahead (#51): the tenant's smaller grant, READ and WRITE only.
    env["INFERLINE_KAFKA__CREATE_REPLY_TOPICS"] = "false"
    rc, out, err = await run_cli(env, "topics", "acls", "--tenant", "acme")
    tenant = [ln.split()[ln.split().index("--operation") + 1] for ln in out.splitlines()]
    tenant = [op for op, ln in zip(tenant, out.splitlines()) if "User:acme" in ln]
    assert rc == 0 and sorted(tenant) == ["Read", "Write", "Write"], (err, tenant)
    del env["INFERLINE_KAFKA__CREATE_REPLY_TOPICS"]
    rc, _, err = await run_cli(env, "topics", "acls", "--tenant", "a.b")
    assert rc != 0 and "must be 1-64 of" in err
    # Tenants named like internal topics (issue 38): refused before anything is printed or created.
    for command in ("acls", "create"):
        for name in ("dlq", "DLQ", "cancel", "default"):
            rc, out, err = await run_cli(
                env, "topics", command, "--tenant", "acme", "--tenant", name
            )
            assert rc != 0 and "reserved" in err and not out, (command, name, err)
