"""SASL/OAUTHBEARER tokens: one provider per process, shared by both Kafka libraries.

aiokafka asks it through `sasl_oauth_token_provider` (async `token()`), confluent-kafka through
its `oauth_cb` config (a callable returning the token and its expiry in Unix seconds). The token
comes from an OIDC token endpoint (client credentials, stdlib urllib) or from a callable named in
settings (`module:function`, returning `(token, expiry_unix_s)`) for cloud-specific signers. It is
cached and fetched again once `REFRESH_AT` of its lifetime has passed; a failed refresh keeps the
cached token while it is still valid. The first token is fetched at start-up, where the clients'
options are built, so a wrong secret stops start-up with the endpoint and client id named.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from aiokafka.abc import AbstractTokenProvider

# Fraction of a token's lifetime after which it is fetched again.
REFRESH_AT = 0.8
HTTP_TIMEOUT_S = 10.0
# Seconds between tries while a refresh fails and the cached token is still valid.
RETRY_S = 5.0

Fetch = Callable[[], tuple[str, float]]


class OAuthTokenError(RuntimeError):
    """No token could be had: the endpoint refused the client, was unreachable, or answered
    something that is not a token."""


def load_callable(spec: str) -> Fetch:
    """The callable `module:function` (a dotted attribute path after the colon)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r}: expected 'module:function'")
    target = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{spec!r} is not callable")
    return target


def jwt_claims(token: str) -> dict:
    """The claims of a JWT, unverified (its `exp` when the endpoint gives no `expires_in`)."""
    try:
        payload = token.split(".")[1]
        return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        return {}


class ClientCredentials:
    """OIDC client credentials grant (RFC 6749 4.4) with client_secret_basic authentication; the
    secret is read from its file on every fetch, so a rotated mounted secret is picked up."""

    def __init__(
        self,
        endpoint: str,
        client_id: str,
        secret: Callable[[], str],
        scope: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.endpoint, self.client_id, self.scope = endpoint, client_id, scope
        self._secret, self._clock = secret, clock

    def __call__(self) -> tuple[str, float]:
        form = {"grant_type": "client_credentials"}
        if self.scope:
            form["scope"] = self.scope
        quote = urllib.parse.quote
        basic = f"{quote(self.client_id, safe='')}:{quote(self._secret(), safe='')}"
        req = urllib.request.Request(
            self.endpoint,
            data=urllib.parse.urlencode(form).encode(),
            headers={
                "Authorization": "Basic " + base64.b64encode(basic.encode()).decode(),
                "Content-Type": "application/x-www-form-urlencoded",
                "Accept": "application/json",
            },
        )
        now = self._clock()
        try:
            with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise self._error(f"refused: HTTP {exc.code} {_oauth_error(exc)}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise self._error(f"unreachable: {getattr(exc, 'reason', exc)}") from None
        except ValueError:
            raise self._error("answered something that is not JSON") from None
        token = body.get("access_token") if isinstance(body, dict) else None
        if not isinstance(token, str) or not token:
            raise self._error("answered without an access_token")
        if isinstance(body.get("expires_in"), (int, float)):
            return token, now + float(body["expires_in"])
        exp = jwt_claims(token).get("exp")
        if not isinstance(exp, (int, float)):
            raise self._error("gave neither expires_in nor a JWT exp claim")
        return token, float(exp)

    def _error(self, what: str) -> OAuthTokenError:
        return OAuthTokenError(
            f"OAuth token endpoint {self.endpoint} for client id {self.client_id!r}: {what}"
        )


def _oauth_error(exc: urllib.error.HTTPError) -> str:
    """The `error` and `error_description` of an RFC 6749 error answer, when it is one."""
    try:
        body = json.loads(exc.read(2048))
        return " ".join(str(body[k]) for k in ("error", "error_description") if k in body)
    except (ValueError, OSError, TypeError):
        return str(exc.reason or "")


class TokenProvider(AbstractTokenProvider):
    """A cached token from `fetch`, for aiokafka (`token()`) and confluent-kafka (`oauth_cb`)."""

    def __init__(
        self,
        fetch: Fetch,
        extensions: dict[str, str] | None = None,
        principal: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._fetch, self._clock = fetch, clock
        self._extensions = dict(extensions or {})
        self._principal = principal
        self._lock = threading.Lock()  # the two libraries ask from different threads
        self._token: str | None = None
        self._expiry = 0.0
        self._refresh_at = 0.0
        self.fetches = 0
        self.asks: Counter[str] = Counter()  # by library: both must come here

    def current(self) -> tuple[str, float]:
        """The token and its expiry (Unix seconds), fetched when none is held or it is due.
        Blocks while fetching; raises OAuthTokenError when no valid token can be had."""
        with self._lock:
            now = self._clock()
            if self._token is not None and now < self._refresh_at:
                return self._token, self._expiry
            try:
                token, expiry = self._fetch()
            except Exception as exc:
                # A passing endpoint outage: the cached token serves until it expires, and the
                # endpoint is asked again after RETRY_S, not by every new connection.
                if self._token is not None and now < self._expiry:
                    self._refresh_at = min(self._expiry, now + RETRY_S)
                    return self._token, self._expiry
                if isinstance(exc, OAuthTokenError):
                    raise
                raise OAuthTokenError(f"the OAuth token provider failed: {exc!r}") from exc
            if not isinstance(token, str) or not token or float(expiry) <= now:
                raise OAuthTokenError(f"the OAuth token provider gave no valid token ({expiry=})")
            self.fetches += 1
            self._token, self._expiry = token, float(expiry)
            self._refresh_at = now + REFRESH_AT * (self._expiry - now)
            return self._token, self._expiry

    def holds_token(self) -> bool:
        return self._token is not None

    def due(self) -> bool:
        return self._token is None or self._clock() >= self._refresh_at

    async def token(self) -> str:
        """aiokafka's hook: a fetch runs in a thread, off the event loop."""
        self.asks["aiokafka"] += 1
        if self.due():
            return (await asyncio.to_thread(self.current))[0]
        return self.current()[0]

    def extensions(self) -> dict[str, str]:
        """SASL extensions sent with the token (KIP-342), e.g. a cluster or pool id."""
        return dict(self._extensions)

    def oauth_cb(self, _config: str) -> tuple:
        """confluent-kafka's hook: (token, expiry, principal, extensions)."""
        self.asks["librdkafka"] += 1
        token, expiry = self.current()
        return token, expiry, self._principal, self.extensions()


_shared: dict[tuple, TokenProvider] = {}
_shared_lock = threading.Lock()


def shared_provider(kafka) -> TokenProvider:
    """The process's provider for these KafkaSettings (one per distinct OAuth setting), holding a
    token: the first fetch happens here, at start-up, and raises OAuthTokenError."""
    key = (
        kafka.oauth_token_provider,
        kafka.oauth_token_endpoint_url,
        kafka.oauth_client_id,
        str(kafka.oauth_client_secret_file),
        kafka.oauth_client_secret.get_secret_value() if kafka.oauth_client_secret else None,
        kafka.oauth_scope,
        tuple(sorted(kafka.oauth_extensions.items())),
    )
    with _shared_lock:
        provider = _shared.get(key)
        if provider is None:
            provider = _shared[key] = _build(kafka)
    if not provider.holds_token():  # later refreshes come from the hooks, off the event loop
        provider.current()
    return provider


def _build(kafka) -> TokenProvider:
    if kafka.oauth_token_provider:
        fetch = load_callable(kafka.oauth_token_provider)
        return TokenProvider(fetch, kafka.oauth_extensions, kafka.oauth_client_id or "")

    def secret() -> str:
        if kafka.oauth_client_secret_file is not None:
            return Path(kafka.oauth_client_secret_file).read_text().strip()
        return kafka.oauth_client_secret.get_secret_value()

    fetch = ClientCredentials(
        kafka.oauth_token_endpoint_url, kafka.oauth_client_id, secret, kafka.oauth_scope
    )
    return TokenProvider(fetch, kafka.oauth_extensions, kafka.oauth_client_id)
