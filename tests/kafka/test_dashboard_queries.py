"""The dashboard proven, not hoped: a real Prometheus (deploy/prometheus/tools.sh) scrapes a real
worker and gateway every second, with the recording rules and alerts loaded, while a short load
goes through the gateway; then every query of the Grafana dashboard (panels and variables, its
variables substituted) and every recorded name must return data, and every rule evaluate."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.gateway_fixtures import fleet  # noqa: F401 - fixture
from tests.prometheus_tools import prometheus_tool
from tests.unit.test_dashboard import ALERTS, DASHBOARD, dashboard_queries, grafana_to_promql
from tests.unit.test_recording_rules import RULES, records

pytestmark = pytest.mark.kafka

CHAT = [{"role": "user", "content": "Name three colours."}]
# Series that only an event the short load cannot make cheaply would create; each says why.
NO_DATA_EXPECTED = {
    # A record read again after its result was final: a worker must die between the result and
    # its offset commit (tests/kafka/test_transactions.py makes one, in a minute, not here).
    "inferline_redeliveries_total": "needs a worker killed between result and commit",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_prometheus(
    binary: str, tmp: Path, worker: str, gateway: str
) -> tuple[subprocess.Popen, str]:
    """Prometheus on a free port, scraping both every second, the rule files loaded. The worker's
    job is named as the pod-annotation convention names it, not compose's `inferline`: the
    dashboard must not depend on the job's name."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES), str(ALERTS)],
        "scrape_configs": [
            {"job_name": "kubernetes-pods", "static_configs": [{"targets": [worker]}]},
            {"job_name": "inferline-gateway", "static_configs": [{"targets": [gateway]}]},
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    address = f"127.0.0.1:{free_port()}"
    args = [
        binary,
        f"--config.file={tmp / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp / 'data'}",
        f"--web.listen-address={address}",
    ]
    with (tmp / "prometheus.log").open("w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://{address}"


async def query(api: httpx.AsyncClient, promql: str) -> list:
    reply = await api.get("/api/v1/query", params={"query": promql})
    body = reply.json()
    assert body["status"] == "success", f"{promql}: {body}"
    return body["data"]["result"]


async def until(what: str, check, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.5)


async def load(url: str) -> None:
    """Chat and completions, whole and streamed, two samples of one prompt, a 429 and a
    client that hangs up mid-stream: every status and path the gateway counts."""
    auth = {"authorization": "Bearer sk-acme"}
    chat = {"messages": CHAT, "max_tokens": 8, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, headers=auth, timeout=60) as http:
        ok = [
            await http.post("/chat/completions", json=chat),
            await http.post("/chat/completions", json={**chat, "stream": True}),
            await http.post("/completions", json={"prompt": "Hello", "max_tokens": 4, "n": 2}),
        ]
        assert [r.status_code for r in ok] == [200] * 3, [r.text for r in ok]
        slow = {"authorization": "Bearer sk-slow"}  # one request, then 429 (gateway_fixtures)
        codes = [(await http.post("/chat/completions", json=chat, headers=slow)).status_code]
        codes.append((await http.post("/chat/completions", json=chat, headers=slow)).status_code)
        assert codes == [200, 429]
        long = {**chat, "max_tokens": 200, "stream": True}
        async with http.stream("POST", "/chat/completions", json=long) as stream:
            async for _ in stream.aiter_lines():
                break  # headers and a first event: the stream is open; then hang up


@pytest.fixture(scope="module")
def prometheus() -> str:
    """Asked for before the fleet, so that a missing binary skips before the fleet starts."""
    return prometheus_tool("prometheus")


async def test_every_panel_and_rule_returns_data(prometheus, fleet, tmp_path):  # noqa: F811
    gateway = fleet.url.removeprefix("http://").removesuffix("/v1")
    worker = f"127.0.0.1:{fleet.worker.http.port}"
    proc, base = start_prometheus(prometheus, tmp_path, worker, gateway)
    try:
        async with httpx.AsyncClient(base_url=base, timeout=10) as api:
            await until("prometheus", lambda: ready(api))
            # Both scraped before the load: a counter must be seen before and after to rate.
            await until("both targets up", lambda: targets_up(api))
            await load(fleet.url)
            await check_queries(api)
    finally:
        proc.terminate()
        proc.wait(30)


async def ready(api: httpx.AsyncClient) -> bool:
    try:
        return (await api.get("/-/ready")).status_code == 200
    except httpx.TransportError:
        return False


async def targets_up(api: httpx.AsyncClient) -> bool:
    return sum(float(s["value"][1]) for s in await query(api, "up")) == 2


def all_queries() -> list[tuple[str, str]]:
    """(where, PromQL): the dashboard's, Grafana's variables substituted, and each recorded
    name (its series exist only once the rule found data)."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = [(where, grafana_to_promql(q)) for where, q in dashboard_queries(dashboard)]
    out += [(f"recording rule {name}", name) for name in records()]
    return [(w, q) for w, q in out if not any(name in q for name in NO_DATA_EXPECTED)]


async def check_queries(api: httpx.AsyncClient) -> None:
    """Every query returns data within a minute (rules are evaluated every 5 s), and every
    rule evaluates without an error."""
    queries = all_queries()
    assert len(queries) > 80
    empty: list[str] = []

    async def all_have_data() -> bool:
        empty[:] = [f"{w}: {q}" for w, q in queries if not await query(api, q)]
        return not empty

    deadline = time.monotonic() + 60
    while not await all_have_data() and time.monotonic() < deadline:
        await asyncio.sleep(1)
    assert not empty, "queries without data:\n" + "\n".join(empty)
    groups = (await api.get("/api/v1/rules")).json()["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    alerts = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    assert len(rules) == len(records()) + len(alerts)
    assert all(r["health"] == "ok" for r in rules), [r for r in rules if r["health"] != "ok"]
