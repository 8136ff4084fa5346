"""The OAUTHBEARER token provider (config/oauth.py) offline: caching, refresh at 80% of a token's
lifetime, a failed refresh riding on a still valid token, the client-credentials request and its
errors against a token endpoint in a thread, and the settings that wire it into both libraries.
On the broker: tests/kafka/test_oauth.py (which reuses this module's TokenEndpoint)."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from pydantic import ValidationError

from inferline.config.oauth import ClientCredentials, OAuthTokenError, TokenProvider
from inferline.config.settings import KafkaSettings

CLIENT_ID, SECRET, SCOPE = "inferline-fleet", "s3cret-of-the-fleet", "kafka"
LIFETIME_S = 6  # short: on the broker, a worker's run outlives its first token


def b64url(value: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()


class TokenEndpoint:
    """An OIDC token endpoint (client credentials, client_secret_basic) in a thread: it issues
    unsigned JWTs (alg none, what Kafka's unsecured validator takes) to CLIENT_ID with SECRET and
    answers 401 invalid_client to anyone else; `requests` records (client id, scope, granted)."""

    def __init__(self, expires_in: bool = True) -> None:
        self.requests: list[tuple[str, str, bool]] = []
        self.forms: list[dict] = []
        self.first_at = 0.0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                form = self.rfile.read(int(self.headers["Content-Length"])).decode()
                endpoint.forms.append(dict(urllib.parse.parse_qsl(form)))
                basic = self.headers.get("Authorization", "Basic ").split()[-1]
                client, _, secret = base64.b64decode(basic).decode().partition(":")
                client, secret = urllib.parse.unquote(client), urllib.parse.unquote(secret)
                granted = (client, secret) == (CLIENT_ID, SECRET)
                scope = endpoint.forms[-1].get("scope", "")
                endpoint.requests.append((client, scope, granted))
                endpoint.first_at = endpoint.first_at or time.time()
                now = int(time.time())
                claims = {"sub": client, "iat": now, "exp": now + LIFETIME_S, "scope": scope}
                body = {"access_token": f"{b64url({'alg': 'none'})}.{b64url(claims)}."}
                if expires_in:  # a second less than exp: the claim's whole seconds
                    body.update(token_type="Bearer", expires_in=LIFETIME_S - 1)
                if not granted:
                    body = {"error": "invalid_client", "error_description": "bad secret"}
                self.send_response(200 if granted else 401)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps(body).encode())

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/oauth2/token"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def granted(self) -> list[tuple[str, str, bool]]:
        return [r for r in self.requests if r[2]]


def secret_file(tmp_path, secret: str):
    path = tmp_path / "client-secret"
    path.write_text(secret + "\n")
    return path


@pytest.fixture
def endpoint():
    server = TokenEndpoint()
    yield server
    server.server.shutdown()


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class Issuer:
    """A fetch giving token-N valid 100 s from the clock, or raising when `down`."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.calls, self.down = clock, 0, False

    def __call__(self) -> tuple[str, float]:
        self.calls += 1
        if self.down:
            raise ConnectionError("endpoint down")
        return f"token-{self.calls}", self.clock.now + 100


def test_a_token_is_reused_until_80_percent_of_its_lifetime_then_fetched_again():
    clock = Clock()
    issuer = Issuer(clock)
    provider = TokenProvider(issuer, clock=clock)
    assert provider.current() == ("token-1", 1_100.0)
    clock.now += 79
    assert provider.current()[0] == "token-1" and issuer.calls == 1
    clock.now += 2  # 81 s of 100
    assert provider.current() == ("token-2", 1_181.0) and issuer.calls == 2


def test_a_failed_refresh_keeps_the_valid_token_retries_later_and_fails_once_it_expired():
    clock = Clock()
    issuer = Issuer(clock)
    provider = TokenProvider(issuer, clock=clock)
    provider.current()
    issuer.down = True
    clock.now += 90  # due, not expired
    assert provider.current()[0] == "token-1" and issuer.calls == 2
    clock.now += 4  # within RETRY_S of the failure: no new try
    assert provider.current()[0] == "token-1" and issuer.calls == 2
    clock.now += 2
    assert provider.current()[0] == "token-1" and issuer.calls == 3
    clock.now += 5  # expired
    with pytest.raises(OAuthTokenError, match="endpoint down"):
        provider.current()


def test_both_libraries_hooks_give_the_one_cached_token():
    clock = Clock()
    issuer = Issuer(clock)
    provider = TokenProvider(issuer, {"logicalCluster": "lkc-1"}, "fleet", clock=clock)
    assert asyncio.run(provider.token()) == "token-1"
    assert provider.oauth_cb("") == ("token-1", 1_100.0, "fleet", {"logicalCluster": "lkc-1"})
    assert provider.extensions() == {"logicalCluster": "lkc-1"}
    assert issuer.calls == 1 and provider.asks == {"aiokafka": 1, "librdkafka": 1}


def test_an_expired_or_empty_token_from_a_provider_is_refused():
    provider = TokenProvider(lambda: ("t", time.time() - 1))
    with pytest.raises(OAuthTokenError, match="no valid token"):
        provider.current()


def test_client_credentials_post_the_grant_and_scope_with_basic_auth(endpoint, tmp_path):
    path = secret_file(tmp_path, SECRET)
    fetch = ClientCredentials(endpoint.url, CLIENT_ID, lambda: path.read_text().strip(), SCOPE)
    before = time.time()
    token, expiry = fetch()
    assert endpoint.forms == [{"grant_type": "client_credentials", "scope": SCOPE}]
    assert endpoint.requests == [(CLIENT_ID, SCOPE, True)]
    assert token.count(".") == 2 and before + LIFETIME_S - 1 <= expiry <= time.time() + LIFETIME_S


def test_without_expires_in_the_jwt_exp_claim_is_the_expiry(tmp_path):
    endpoint = TokenEndpoint(expires_in=False)
    try:
        token, expiry = ClientCredentials(endpoint.url, CLIENT_ID, lambda: SECRET)()
    finally:
        endpoint.server.shutdown()
    claims = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "=="))
    assert expiry == claims["exp"]


def test_a_wrong_secret_is_an_error_naming_endpoint_and_client_not_the_secret(endpoint):
    fetch = ClientCredentials(endpoint.url, CLIENT_ID, lambda: "not-the-secret", SCOPE)
    with pytest.raises(OAuthTokenError) as refused:
        TokenProvider(fetch).current()
    message = str(refused.value)
    assert endpoint.url in message and repr(CLIENT_ID) in message
    assert "HTTP 401 invalid_client bad secret" in message and "not-the-secret" not in message


def test_an_unreachable_endpoint_is_an_error_naming_it():
    endpoint = TokenEndpoint()
    endpoint.server.shutdown()
    endpoint.server.server_close()
    with pytest.raises(OAuthTokenError, match="unreachable"):
        ClientCredentials(endpoint.url, CLIENT_ID, lambda: SECRET)()


def oauth_settings(**overrides) -> KafkaSettings:
    return KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="OAUTHBEARER", **overrides)


def test_settings_wire_one_provider_into_both_libraries_and_fetch_at_once(endpoint, tmp_path):
    kafka = oauth_settings(
        oauth_token_endpoint_url=endpoint.url,
        oauth_client_id=CLIENT_ID,
        oauth_client_secret_file=secret_file(tmp_path, SECRET),
        oauth_scope=SCOPE,
    )
    opts, config = kafka.connection_options(), kafka.librdkafka_config()
    assert len(endpoint.requests) == 1  # fetched when the options were built, once
    provider = opts["sasl_oauth_token_provider"]
    assert opts["sasl_mechanism"] == config["sasl.mechanism"] == "OAUTHBEARER"
    assert config["oauth_cb"].__self__ is provider and "sasl.username" not in config


def test_a_wrong_secret_fails_where_the_options_are_built(endpoint):
    kafka = oauth_settings(
        oauth_token_endpoint_url=endpoint.url, oauth_client_id=CLIENT_ID, oauth_client_secret="x"
    )
    with pytest.raises(OAuthTokenError, match="HTTP 401"):
        kafka.librdkafka_config()


def signer() -> tuple[str, float]:
    return "signed-by-the-cloud", time.time() + 900


def test_a_named_callable_is_the_token_source():
    kafka = oauth_settings(oauth_token_provider=f"{__name__}:signer")
    assert kafka.librdkafka_config()["oauth_cb"]("")[0] == "signed-by-the-cloud"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({}, "oauth_token_endpoint_url, oauth_client_id, oauth_client_secret"),
        ({"oauth_token_provider": "no_such_module:f"}, "no callable"),
        ({"oauth_token_provider": "json"}, "module:function"),
    ],
)
def test_incomplete_oauth_settings_are_refused(overrides, match):
    with pytest.raises(ValidationError, match=match):
        oauth_settings(**overrides)


def test_the_passthroughs_cannot_replace_the_token_hooks():
    with pytest.raises(ValidationError, match="oauth_cb"):
        KafkaSettings(librdkafka={"oauth_cb": "x"})
    with pytest.raises(ValidationError, match="sasl.oauthbearer.method"):
        KafkaSettings(librdkafka={"sasl.oauthbearer.method": "oidc"})
