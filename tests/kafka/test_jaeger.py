"""Traces seen where an operator sees them: a real Jaeger v2 (deploy/jaeger/tools.sh, `make
jaeger-tools`; in-memory storage, OTLP/HTTP in) receives the spans of a gateway process and of a
worker, both set up from the standard OTEL_* variables, while requests with an HTTP traceparent go
through the gateway, Kafka and the worker. Jaeger's query API must then hold one trace per request:
the gateway's server span, the client's submit span under it, and across the Kafka hop the
worker's inferline.request with its five phases, contiguous, in order and inside the request.

Jaeger takes minutes to build, so `make test` does not build it: this module runs when the binary
is in the cache and otherwise skips, naming `make jaeger-tools`; `make trace-check` builds it and
sets INFERLINE_REQUIRE_JAEGER=1, which turns that skip into a failure. The in-process form, with
the SDK's in-memory exporter: tests/kafka/test_tracing.py."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest
import yaml

from inferline.config import tracing
from inferline.config.settings import Settings
from inferline.worker.app import Worker, engine_settings
from inferline.worker.engine.engine import LLMEngine
from tests.gateway_fixtures import delete_topics, make_topics
from tests.kafka.test_dashboard_queries import free_port, until
from tests.unit.test_tracing import WORKER_SPANS
from tests.worker_fixtures import PROMPTS, wait_ready, worker_config

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "deploy" / "jaeger" / "tools.sh"
SERVER_SPAN = "POST /v1/chat/completions"
PHASES = [  # in the order a request passes them
    "inferline.kafka_wait",
    "inferline.pool_wait",
    "inferline.prefill",
    "inferline.decode",
    "inferline.delivery",
]
assert set(PHASES) == WORKER_SPANS
# Jaeger keeps microseconds; a Kafka record's timestamp (the start of kafka_wait) milliseconds.
US, MS = 1, 1000
N = 3  # requests


def jaeger_binary() -> str:
    path = subprocess.run([str(TOOLS), "--path"], capture_output=True, text=True, check=True)
    path = path.stdout.strip()
    if os.access(path, os.X_OK):
        return path
    why = f"Jaeger is not built ({path}): `make jaeger-tools` builds it (minutes, once)"
    if os.environ.get("INFERLINE_REQUIRE_JAEGER") == "1":
        pytest.fail(why, pytrace=False)
    pytest.skip(why, allow_module_level=True)


# At collection: without Jaeger the module skips before the broker and the model are set up.
JAEGER = jaeger_binary()


def jaeger_config(otlp: str, query: str, grpc: str) -> dict:
    """All in one on free ports: OTLP/HTTP in, memory storage, the query API; nothing else
    listens (no UI assets, no own metrics)."""
    return {
        "service": {
            "extensions": ["jaeger_storage", "jaeger_query"],
            "pipelines": {
                "traces": {
                    "receivers": ["otlp"],
                    "processors": ["batch"],
                    "exporters": ["jaeger_storage_exporter"],
                }
            },
            "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "warn"}},
        },
        "extensions": {
            "jaeger_storage": {"backends": {"memory": {"memory": {"max_traces": 1000}}}},
            "jaeger_query": {
                "storage": {"traces": "memory"},
                "max_clock_skew_adjust": "0s",  # the times as sent
                "http": {"endpoint": query},
                "grpc": {"endpoint": grpc},
            },
        },
        "receivers": {"otlp": {"protocols": {"http": {"endpoint": otlp}}}},
        "processors": {"batch": {"timeout": "100ms"}},
        "exporters": {"jaeger_storage_exporter": {"trace_storage": "memory"}},
    }


def otel_env(otlp: str, service: str) -> dict[str, str]:
    """The standard variables an operator sets: OTLP over HTTP to Jaeger, spans sent every
    100 ms (the SDK's default is 5 s)."""
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{otlp}",
        "OTEL_SERVICE_NAME": service,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }


def log_tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@pytest.fixture(scope="module")
async def jaeger(tmp_path_factory):
    """(OTLP/HTTP address, query API base URL) of a fresh Jaeger."""
    tmp = tmp_path_factory.mktemp("jaeger")
    otlp, query, grpc = (f"127.0.0.1:{free_port()}" for _ in range(3))
    (tmp / "jaeger.yaml").write_text(yaml.safe_dump(jaeger_config(otlp, query, grpc)))
    log = tmp / "jaeger.log"
    with log.open("w") as out:  # the child keeps its own descriptor
        args = [JAEGER, "--config", f"file:{tmp / 'jaeger.yaml'}"]
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        await until("Jaeger", lambda: answers(proc, log, f"http://{query}/api/services"))
        yield otlp, f"http://{query}"
    finally:
        proc.kill()  # its storage is memory: nothing to lose (it takes 15 s to stop on SIGTERM)
        proc.wait(30)


async def answers(proc: subprocess.Popen, log: Path, url: str) -> bool:
    """Whether `url` answers 200; fails, with its log, if `proc` exited."""
    assert proc.poll() is None, f"{proc.args[0]} exited {proc.returncode}:\n{log_tail(log)}"
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            return (await http.get(url)).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
async def traced_worker(kafka_bootstrap, shallow_runner, jaeger):
    """A worker in this process over the shallow model, its tracing set up from OTEL_* as
    `python -m inferline.worker` sets it up; yields (topics, worker)."""
    topics = await make_topics(kafka_bootstrap)
    with pytest.MonkeyPatch.context() as env:
        for name, value in otel_env(jaeger[0], "inferline-worker").items():
            env.setenv(name, value)
        assert tracing.setup_tracing("inferline-worker", set_global=False)
    settings = Settings(**worker_config(kafka_bootstrap, topics))
    worker = Worker(settings, LLMEngine(shallow_runner, engine_settings(settings)))
    task = asyncio.create_task(worker.run())
    try:
        await wait_ready(worker, task)
        yield topics, worker
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 60)
        tracing.reset_tracing()  # exports what is left; later tests run with tracing off
        await delete_topics(kafka_bootstrap, topics)


@pytest.fixture(scope="module")
async def gateway(kafka_bootstrap, traced_worker, jaeger, tmp_path_factory):
    """`python -m inferline.producer.gateway` (no API keys: one default tenant), its tracing
    from OTEL_*; yields its OpenAI base URL."""
    topics, _ = traced_worker
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERLINE_", "OTEL_"))}
    env.update(otel_env(jaeger[0], "inferline-gateway"))
    env.update(
        INFERLINE_KAFKA__BOOTSTRAP_SERVERS=kafka_bootstrap,
        INFERLINE_KAFKA__REQUEST_TOPIC=topics.requests,
        INFERLINE_KAFKA__CANCEL_TOPIC=topics.cancel,
    )
    port = free_port()
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with log.open("w") as out:
        args = [sys.executable, "-P", "-m", "inferline.producer.gateway"]
        args += ["--host", "127.0.0.1", "--port", str(port)]
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        await until("the gateway", lambda: answers(proc, log, f"{base}/readyz"), timeout=90)
        yield f"{base}/v1"
    finally:
        proc.terminate()
        proc.wait(30)


async def chat(http: httpx.AsyncClient, prompt: str, stream: bool) -> tuple[str, str, dict]:
    """One chat completion with a fresh traceparent: (trace id, the caller's span id, usage)."""
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 6}
    headers = {"traceparent": f"00-{trace_id}-{parent}-01"}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    response = await http.post("/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    if not stream:
        return trace_id, parent, response.json()["usage"]
    chunks = [line.removeprefix("data: ") for line in response.text.splitlines()]
    chunks = [json.loads(c) for c in chunks if c.startswith("{")]
    return trace_id, parent, [c["usage"] for c in chunks if c.get("usage")][-1]


async def jaeger_trace(api: httpx.AsyncClient, trace_id: str) -> list[dict]:
    """Jaeger's traces with this id (its JSON API), each span with its service name."""
    reply = await api.get(f"/api/traces/{trace_id}")
    if reply.status_code == 404:
        return []
    reply.raise_for_status()
    traces = reply.json()["data"] or []
    for t in traces:
        for span in t["spans"]:
            span["service"] = t["processes"][span["processID"]]["serviceName"]
    return traces


def tags(span: dict) -> dict:
    return {t["key"]: t["value"] for t in span["tags"]}


def parent_id(span: dict) -> str | None:
    refs = [r["spanID"] for r in span["references"] if r["refType"] == "CHILD_OF"]
    assert len(refs) <= 1, span
    return refs[0] if refs else None


def end(span: dict) -> int:
    return span["startTime"] + span["duration"]


def check_trace(spans: list[dict], parent: str, usage: dict) -> None:
    """One request's spans, as Jaeger shows them."""
    names = [s["operationName"] for s in spans]
    expected = [SERVER_SPAN, "inferline.submit", "inferline.request", *PHASES]
    assert sorted(names) == sorted(expected), [
        (s["operationName"], s["spanID"], parent_id(s), s["service"]) for s in spans
    ]
    by_name = {s["operationName"]: s for s in spans}
    server, submit = by_name[SERVER_SPAN], by_name["inferline.submit"]
    root = by_name["inferline.request"]
    assert (server["service"], submit["service"]) == ("inferline-gateway",) * 2
    assert {by_name[n]["service"] for n in ["inferline.request", *PHASES]} == {"inferline-worker"}
    # The parents: the HTTP caller, the gateway's server span, and across Kafka the submit span.
    assert parent_id(server) == parent
    assert parent_id(submit) == server["spanID"]
    assert parent_id(root) == submit["spanID"]
    assert all(parent_id(by_name[n]) == root["spanID"] for n in PHASES)
    # The phases tile the request span: each begins where the one before ended.
    phases = [by_name[n] for n in PHASES]
    assert phases[0]["startTime"] == root["startTime"]
    for before, after in zip(phases, phases[1:]):
        assert abs(after["startTime"] - end(before)) <= US, (before, after)
    assert abs(end(phases[-1]) - end(root)) <= US
    assert all(p["duration"] >= 0 for p in phases)
    assert by_name["inferline.prefill"]["duration"] > 0  # a forward pass takes time
    # Causality across the hop: sent after the gateway took it, first token before its answer.
    assert server["startTime"] <= submit["startTime"] <= root["startTime"] + MS
    assert end(by_name["inferline.prefill"]) <= end(server)
    attributes = tags(root)
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["inferline.delivery.outcome"]
    assert tags(server)["http.response.status_code"] == 200


async def test_jaeger_shows_one_trace_per_request_across_the_kafka_hop(jaeger, gateway):
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as http:
        sent = await asyncio.gather(
            *(chat(http, PROMPTS[i], stream=i == N - 1) for i in range(N))  # one streamed
        )
    # The worker's delivery span ends at its `done`'s commit, after the gateway's answer: wait
    # until each service has sent every span (both export every 100 ms), wherever they went.
    async with httpx.AsyncClient(base_url=jaeger[1], timeout=10) as api:

        async def all_in() -> bool:
            spans = await service_spans(api, "inferline-gateway")
            spans += await service_spans(api, "inferline-worker")
            names = Counter(s["operationName"] for _, s in spans)  # not GET /readyz's
            every = [SERVER_SPAN, "inferline.submit", "inferline.request", *PHASES]
            return all(names[n] == N for n in every)

        await until("every span in Jaeger", all_in, timeout=60)
        for trace_id, parent, usage in sent:
            traces = await jaeger_trace(api, trace_id)
            assert len(traces) == 1, trace_id
            check_trace(traces[0]["spans"], parent, usage)
        # The worker started no trace of its own: each of its spans is in a request's trace.
        found = {trace_id for trace_id, _ in await service_spans(api, "inferline-worker")}
        assert found == {trace_id for trace_id, _, _ in sent}


async def service_spans(api: httpx.AsyncClient, service: str) -> list[tuple[str, dict]]:
    """(trace id, span) for every span `service` sent, whichever trace it is in."""
    reply = await api.get("/api/traces", params={"service": service, "limit": 100})
    if reply.status_code != 200:  # no span from it yet
        return []
    out = []
    for t in reply.json()["data"] or []:
        ids = {p for p, v in t["processes"].items() if v["serviceName"] == service}
        out += [(t["traceID"], s) for s in t["spans"] if s["processID"] in ids]
    return out
