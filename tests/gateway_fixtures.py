"""A fleet for the gateway's tests: fresh topics, one in-process worker over the session's shared
model, and the gateway under uvicorn on a free port, shared by a test module.

    fleet (module, async) -> Fleet     .url (the OpenAI base URL), .topics, .settings, .worker,
                                       .server
    shallow_fleet (module, async)      the same over the 4-layer shallow model
    start_gateway(settings)            another gateway in this process: (server, task, base url)
    make_topics / delete_topics        the topics of a fleet (with per-tenant ones for topic
                                       tenancy)
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from inferline.config.settings import Settings
from inferline.producer.gateway.server import GatewayServer, make_server
from inferline.producer.replies import REPLY_TOPIC_PREFIX
from tests.kafka_fixtures import create_named_topics
from tests.worker_fixtures import Topics, wait_ready, worker_config
from inferline.worker.app import Worker, engine_settings
from inferline.worker.engine.engine import LLMEngine

KEYS = {"sk-acme": "acme", "sk-slow": "slow"}
# Tenant `slow` may send one request and then one every 1000 s: its second gets 429.
LIMITS = {"tenants": {"slow": {"requests_per_s": 0.001, "burst_requests": 1}}}


@dataclass
class Fleet:
    url: str
    topics: Topics
    settings: Settings
    worker: Worker
    server: GatewayServer


def gateway_settings(bootstrap: str, topics: Topics, tenancy: str = "body", **gateway) -> Settings:
    return Settings(
        kafka={
            "bootstrap_servers": bootstrap,
            "request_topic": topics.requests,
            "cancel_topic": topics.cancel,
            "tenancy": tenancy,
        },
        gateway={"host": "127.0.0.1", "port": 0, "api_keys": KEYS, **gateway},
    )


async def start_gateway(settings: Settings) -> tuple[GatewayServer, asyncio.Task, str]:
    server = make_server(settings)
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + 60
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("the gateway stopped before it started")
        assert time.monotonic() < deadline, "the gateway did not start"
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, task, f"http://127.0.0.1:{port}/v1"


async def stop_gateway(server: GatewayServer, task: asyncio.Task) -> None:
    server.should_exit = True
    await asyncio.wait_for(task, 60)


async def make_topics(bootstrap: str, tenants: tuple[str, ...] = ()) -> Topics:
    """Fresh request/cancel/dlq/reply topics, and each tenant's `<request>.<t>`, `<cancel>.<t>`."""
    stem = f"test-gateway-{uuid.uuid4().hex[:10]}"
    names = Topics(
        requests=f"{stem}-req",
        cancel=f"{stem}-cancel",
        dlq=f"{stem}-dlq",
        replies=f"{REPLY_TOPIC_PREFIX}{stem}",
    )
    parts = {names.requests: 2, names.cancel: 1, names.dlq: 1, names.replies: 1}
    for t in tenants:
        parts.update({f"{names.requests}.{t}": 2, f"{names.cancel}.{t}": 1})
    await create_named_topics(parts, bootstrap_servers=bootstrap)
    return names


async def delete_topics(bootstrap: str, topics: Topics, tenants: tuple[str, ...] = ()) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        own = [f"{base}.{t}" for t in tenants for base in (topics.requests, topics.cancel)]
        await admin.delete_topics(
            [topics.requests, topics.cancel, topics.dlq, topics.replies, *own]
        )
    finally:
        await admin.close()


async def run_fleet(kafka_bootstrap: str, runner):
    """Topics, a worker over `runner` and a gateway; yields the Fleet, then stops it all."""
    topics = await make_topics(kafka_bootstrap)
    wsettings = Settings(**worker_config(kafka_bootstrap, topics, limits=LIMITS))
    worker = Worker(wsettings, LLMEngine(runner, engine_settings(wsettings)))
    wtask = asyncio.create_task(worker.run())
    await wait_ready(worker, wtask)
    settings = gateway_settings(kafka_bootstrap, topics)
    server, gtask, url = await start_gateway(settings)
    yield Fleet(url, topics, settings, worker, server)
    await stop_gateway(server, gtask)
    worker.request_stop()
    await asyncio.wait_for(wtask, 60)
    await delete_topics(kafka_bootstrap, topics)


@pytest.fixture(scope="module")
async def fleet(kafka_bootstrap, model_runner):
    async for f in run_fleet(kafka_bootstrap, model_runner):
        yield f


@pytest.fixture(scope="module")
async def shallow_fleet(kafka_bootstrap, shallow_runner):
    """The same fleet over the 4-layer model, for tests about fields rather than text."""
    async for f in run_fleet(kafka_bootstrap, shallow_runner):
        yield f
