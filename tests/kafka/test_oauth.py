"""SASL/OAUTHBEARER on the wire: a SASL_SSL broker of the test's own that takes OAUTHBEARER
(scripts/kafka/sasl_ssl.sh, INFERLINE_KAFKA_OAUTH=1: Kafka's unsecured validator, unsigned JWTs
whose scope must hold `kafka`) and a token endpoint the test runs (client credentials: unsigned
JWTs for the right secret, 401 otherwise).

- The Python client and the gateway send requests that an in-process worker (group mode:
  aiokafka publisher, cancel listener and lookups; confluent-kafka consumer, transactional
  producer and admin) answers, every client authenticated by tokens from the one provider
  (config/oauth.py); both libraries asked it, and short-lived tokens were fetched again.
- A wrong client secret stops the worker's and the client's start-up at once with the endpoint
  and the client id named.

The provider's caching, refresh and errors offline: tests/unit/test_oauth.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from confluent_kafka.admin import AdminClient

from inferline.config.oauth import OAuthTokenError
from inferline.config.settings import KafkaSettings, Settings
from inferline.worker.app import Worker, engine_settings
from inferline.worker.engine.engine import LLMEngine
from tests.kafka.test_security import SaslBroker, running
from tests.kafka_fixtures import create_named_topics
from tests.unit.test_oauth import CLIENT_ID, LIFETIME_S, SCOPE, SECRET, TokenEndpoint, secret_file
from tests.worker_fixtures import Topics, wait_ready, worker_config

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


class OAuthBroker(SaslBroker):
    def __init__(self, kdir) -> None:
        super().__init__(kdir)
        self.env["INFERLINE_KAFKA_OAUTH"] = "1"

    def oauth(self, endpoint: TokenEndpoint, secret_path, **overrides) -> dict:
        """The `kafka` settings of an OAUTHBEARER client of this broker."""
        return {
            "bootstrap_servers": self.bootstrap,
            "security_protocol": "SASL_SSL",
            "ssl_cafile": str(self.cafile),
            "sasl_mechanism": "OAUTHBEARER",
            "oauth_token_endpoint_url": endpoint.url,
            "oauth_client_id": CLIENT_ID,
            "oauth_client_secret_file": str(secret_path),
            "oauth_scope": SCOPE,
            **overrides,
        }


@pytest.fixture(scope="module")
def oauth_broker(tmp_path_factory):
    yield from running(OAuthBroker(tmp_path_factory.mktemp("kafka-oauth")))


@pytest.fixture
def endpoint():
    server = TokenEndpoint()
    yield server
    server.server.shutdown()


async def test_client_and_worker_serve_over_oauthbearer(
    oauth_broker, endpoint, model_runner, tmp_path
):
    from inferline.producer.client import InferenceClient

    stem = uuid.uuid4().hex[:6]
    topics = Topics(f"oa-req-{stem}", f"oa-cancel-{stem}", f"oa-dlq-{stem}", "unused")
    kafka = oauth_broker.oauth(endpoint, secret_file(tmp_path, SECRET))
    options = KafkaSettings(**kafka).connection_options()
    await create_named_topics({topics.requests: 1, topics.cancel: 1, topics.dlq: 1}, **options)
    settings = Settings(**worker_config(oauth_broker.bootstrap, topics, kafka=kafka))
    worker = Worker(settings, LLMEngine(model_runner, engine_settings(settings)))
    task = asyncio.create_task(worker.run())
    try:
        await wait_ready(worker, task, timeout=120)
        client = InferenceClient(request_topic=topics.requests, settings=Settings(kafka=kafka))
        async with client:
            handle = await client.submit("Say hi.", max_tokens=3)
            result = await asyncio.wait_for(handle.result(), 120)
        assert result.finish_reason == "length"
        await gateway_completion(kafka, topics)
        provider = settings.kafka.oauth()
        # Past the first token's lifetime, a new connection has the provider fetch anew.
        await asyncio.sleep(max(0.0, endpoint.first_at + LIFETIME_S + 0.5 - time.time()))
        await create_named_topics({f"oa-later-{stem}": 1}, **options)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 60)
    assert provider.asks["aiokafka"] > 0 and provider.asks["librdkafka"] > 0, provider.asks
    granted = endpoint.granted()
    assert granted and all(r[:2] == (CLIENT_ID, SCOPE) for r in granted), endpoint.requests
    assert len(granted) >= 2, "no token was fetched again before the first expired"
    assert len(granted) == len(endpoint.requests)  # nothing refused


async def gateway_completion(kafka: dict, topics: Topics) -> None:
    """A chat completion through an in-process gateway on the same OAuth settings."""
    import httpx

    from tests.gateway_fixtures import KEYS, start_gateway, stop_gateway

    gateway_kafka = {**kafka, "request_topic": topics.requests, "cancel_topic": topics.cancel}
    settings = Settings(
        kafka=gateway_kafka, gateway={"host": "127.0.0.1", "port": 0, "api_keys": KEYS}
    )
    server, task, url = await start_gateway(settings)
    try:
        headers = {"Authorization": "Bearer sk-acme"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:
            model = (await http.get("/models")).json()["data"][0]["id"]
            chat = [{"role": "user", "content": "Hi."}]
            body = {"model": model, "messages": chat, "max_tokens": 3}
            answer = await http.post("/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] == "length"
    finally:
        await stop_gateway(server, task)


async def test_a_wrong_secret_stops_start_up_naming_endpoint_and_client(
    oauth_broker, endpoint, model_runner, tmp_path
):
    from inferline.producer.client import InferenceClient

    stem = uuid.uuid4().hex[:6]
    topics = Topics(f"oa-req-{stem}", f"oa-cancel-{stem}", f"oa-dlq-{stem}", "unused")
    kafka = oauth_broker.oauth(endpoint, secret_file(tmp_path, "not-the-secret"))
    settings = Settings(**worker_config(oauth_broker.bootstrap, topics, kafka=kafka))
    worker = Worker(settings, LLMEngine(model_runner, engine_settings(settings)))
    # Seconds at most: the endpoint's 401 ends start-up (no retry loop, no librdkafka timeout).
    with pytest.raises(OAuthTokenError) as stopped:
        await asyncio.wait_for(worker.run(), 30)
    message = str(stopped.value)
    assert endpoint.url in message and repr(CLIENT_ID) in message and "401" in message
    assert "not-the-secret" not in message
    client = InferenceClient(request_topic=topics.requests, settings=Settings(kafka=kafka))
    with pytest.raises(OAuthTokenError, match="HTTP 401 invalid_client"):
        await asyncio.wait_for(client.start(), 30)
    # A confluent-kafka client made first (share intake's admin, `inferline topics acls`): a
    # raising oauth_cb would leave its constructor waiting 10 s, then "OAuth token not set".
    with pytest.raises(OAuthTokenError, match="HTTP 401 invalid_client"):
        AdminClient(KafkaSettings(**kafka).librdkafka_config())
    assert endpoint.requests and not endpoint.granted()
