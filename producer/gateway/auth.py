"""API keys -> tenants, from INFERLINE_GATEWAY__API_KEYS and INFERLINE_GATEWAY__API_KEYS_FILE; with
none configured, no key is asked for."""

from __future__ import annotations

import hmac
import json
import re

from inferline.config.settings import GatewaySettings, KafkaSettings
from inferline.producer.gateway.errors import OpenAIError
from inferline.contract.schema import TENANT_PATTERN
from inferline.contract.topics import tenant_problem


def load_keys(settings: GatewaySettings, topic_tenancy: bool, kafka=None) -> dict[str, str]:
    """Every key with its tenant; a tenant name topic tenancy cannot carry stops start-up."""
    keys = dict(settings.api_keys)
    if settings.api_keys_file is not None:
        keys.update(json.loads(settings.api_keys_file.read_text()))
    for tenant in keys.values():
        if topic_tenancy:
            problem = tenant_problem(tenant, kafka if kafka is not None else KafkaSettings())
        else:
            problem = (
                None
                if isinstance(tenant, str) and re.match(TENANT_PATTERN, tenant)
                else f"must match {TENANT_PATTERN}"
            )
        if problem:
            raise SystemExit(
                f"invalid setting INFERLINE_GATEWAY__API_KEYS: tenant {tenant!r} {problem}"
            )
    if topic_tenancy and not keys:
        raise SystemExit(
            "INFERLINE_KAFKA__TENANCY=topic needs INFERLINE_GATEWAY__API_KEYS: "
            "keys name the tenants"
        )
    return keys


class ApiKeys:
    def __init__(self, keys: dict[str, str]):
        self._keys = keys

    @property
    def required(self) -> bool:
        return bool(self._keys)

    @property
    def tenants(self) -> set[str]:
        return set(self._keys.values())

    def tenant_of(self, authorization: str | None) -> str | None:
        """The tenant of the request's bearer key (None when keys are off); 401 otherwise."""
        if not self._keys:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise OpenAIError(
                401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
        key = key.strip()
        # Compare with every key in constant time: no hint of how much of a key matched.
        found = [t for k, t in self._keys.items() if hmac.compare_digest(k.encode(), key.encode())]
        if not found:
            raise OpenAIError(401, "incorrect API key provided", code="invalid_api_key")
        return found[0]
