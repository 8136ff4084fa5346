#!/usr/bin/env python3
"""Writes docs/configuration.md, the settings reference, from config/settings.py.

    python scripts/gen_config_docs.py           # rewrite docs/configuration.md
    python scripts/gen_config_docs.py --check   # exit 1 if the checked-in file is stale

Names, types, defaults and bounds come from the pydantic models; each meaning comes from the
comment above the field in config/settings.py, else from MEANINGS below. A field with neither
stops this script, so a new setting cannot go undocumented. tests/unit/test_docs.py checks the file.
"""

from __future__ import annotations

import ast
import inspect
import re
import importlib.util
import sys
import types
import typing
from pathlib import Path

import annotated_types
from pydantic import BaseModel, SecretStr

REPO = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("scripts") is None:  # run as a script, not imported by the suite
    sys.path.append(str(REPO))  # after site-packages: HF `kernels` stays first

from inferline.config import settings as settings_module  # noqa: E402
from inferline.config.settings import ENV_DELIMITER, ENV_PREFIX, Settings  # noqa: E402
from scripts.generated import cli  # noqa: E402

OUT = REPO / "docs" / "configuration.md"
SOURCE = Path(settings_module.__file__)

SECTIONS = {
    "kafka": "Brokers, topics, the consumer group, reply batching, and security.",
    "model": "Which model runs, where, and in what precision.",
    "cache": "The paged KV cache: block size and how many blocks (see docs/operations.md for "
    "sizing).",
    "scheduler": "Continuous batching: how many sequences and tokens one engine step takes, and "
    "the waiting pool.",
    "lanes": "Requests read past the waiting pool, in per-tenant lanes (docs/operations.md, "
    '"Lanes"): their bounds.',
    "engine": "The engine step: whether step N+1 is prepared while step N runs.",
    "speculative": "Speculative decoding (off by default): n-gram drafts for greedy requests, "
    "verified in the same step; greedy output is unchanged.",
    "structured": "Structured outputs (grammars): the compile time budget, the compile pool and "
    "the compiled-grammar cache (docs/security.md).",
    "limits": "Per-request caps, deadlines, per-tenant rate limits, and load shedding.",
    "http": "The /healthz, /readyz and /metrics server.",
    "log": "Structured logs (structlog).",
    "worker": "Identity and shutdown.",
    "gateway": "The OpenAI-compatible HTTP gateway (`inferline gateway`, docs/gateway.md); it "
    "reads the `kafka` section too.",
}

# For fields without a comment in config/settings.py, or whose comment needs the context of its
# neighbours; these win over the comment. Keep to what the code does.
MEANINGS = {
    "kafka.bootstrap_servers": "Kafka brokers, `host:port[,host:port...]`.",
    "kafka.request_topic": "Topic the workers consume requests from, as one consumer group.",
    "kafka.cancel_topic": "Topic of cancel messages; every worker reads all its partitions, "
    "without a group.",
    "kafka.dlq_topic": "Where undecodable request records are copied (dead-letter topic).",
    "kafka.group_id": "Consumer group of the workers on the request topic.",
    "kafka.client_id": "Client id of the worker's Kafka clients (shows in broker logs and quotas).",
    "kafka.session_timeout_ms": "Consumer group session timeout; heartbeats every quarter of it. "
    "A revoked partition's requests get half of it to be requeued.",
    "kafka.security_protocol": "Protocol to the brokers.",
    "kafka.sasl_username": "SASL user name.",
    "kafka.sasl_password": "SASL password (never logged).",
    "kafka.sasl_mechanism": "SASL mechanism, with `SASL_PLAINTEXT` or `SASL_SSL`; `OAUTHBEARER` "
    "takes tokens from the `oauth_*` settings (docs/security.md).",
    "kafka.oauth_token_endpoint_url": "OAUTHBEARER: the OIDC token endpoint, asked for client "
    "credentials tokens (one provider per process for every Kafka client); the first is fetched "
    "at start-up (a refusal stops it naming endpoint and client id), the next at 80% of a "
    "token's lifetime.",
    "kafka.oauth_client_id": "OAUTHBEARER: the client id at the token endpoint.",
    "kafka.oauth_client_secret": "OAUTHBEARER: the client secret (never logged).",
    "kafka.oauth_client_secret_file": "OAUTHBEARER: the client secret read from a file (a mounted "
    "secret) instead, read again at each token request.",
    "kafka.oauth_scope": "OAUTHBEARER: the `scope` of the token request (space-separated).",
    "kafka.ssl_cafile": "CA bundle to verify the brokers, with `SSL` or `SASL_SSL`.",
    "kafka.ssl_certfile": "Client certificate (mutual TLS).",
    "kafka.ssl_keyfile": "Client private key (mutual TLS).",
    "model.device": "`auto`: CUDA when available, else CPU.",
    "model.dtype": "`auto`: bfloat16 on CUDA, float32 on CPU.",
    "model.max_model_len": "Prompt plus `max_tokens` at most, in tokens; capped by the model's "
    "`max_position_embeddings`. Longer requests are rejected with `prompt_too_long`.",
    "cache.block_size": "Tokens per KV cache block; a power of two.",
    "cache.kv_memory_gb": "CPU: the KV cache size in GB (10^9 bytes). Not used on CUDA.",
    "cache.gpu_memory_utilization": "CUDA: fraction of the free GPU memory (measured after the "
    "model loads) given to the KV cache.",
    "scheduler.policy": "`continuous`: requests join and leave the batch at every step. `static`: "
    "a new batch forms only when the last one has finished (a baseline for benchmarks).",
    "scheduler.max_num_seqs": "Sequences in the running batch at most.",
    "scheduler.max_num_batched_tokens": "Tokens per engine step at most, decodes and prefill "
    "chunks together; longer prompts are prefilled in chunks over several steps.",
    "scheduler.max_waiting": "Requests taken from Kafka and not yet running, per worker. When "
    "full, intake pauses its partitions.",
    "limits.default_timeout_s": "Deadline of a request without `timeout_s`: seconds from its "
    "`created_at` (or from receipt). Past it the request ends with `timeout`.",
    "limits.overload_reject_after_s": "Once the waiting pool has been full this long, new "
    "requests are rejected with `overloaded` instead of waiting in Kafka; unset: never.",
    "limits.default_tenant": "Rate limits of every tenant not named in `tenants`.",
    "limits.tenants": "Rate limits by tenant name (the request's `tenant` field).",
    "tenant.requests_per_s": "Requests per second (token bucket); unset: no limit.",
    "tenant.tokens_per_min": "Generated tokens per minute, charged at admission with the request's "
    "`max_tokens` and refunded by what it did not use; unset: no limit.",
    "tenant.burst_requests": "Request bucket size; default `max(1, requests_per_s)`.",
    "tenant.min_priority": "Requests' `priority` is raised to at least this (lower runs first and "
    "may preempt), in every tenancy mode: a tenant cannot jump ahead of others by its own say; "
    "unset: `INFERLINE_LIMITS__MIN_PRIORITY`.",
    "tenant.max_priority": "Requests' `priority` is lowered to at most this; unset: "
    "`INFERLINE_LIMITS__MAX_PRIORITY`.",
    "http.host": "Address the HTTP server binds.",
    "http.port": "Port of /healthz, /readyz and /metrics; 0 picks a free one.",
    "log.level": "Lowest level logged.",
    "log.format": "`auto`: console on a terminal, JSON lines otherwise.",
    "gateway.host": "Address the gateway binds.",
    "worker.drain_timeout_s": "On SIGTERM or SIGINT: seconds running requests get to finish "
    "before they are requeued (a second signal stops waiting).",
}

# INFERLINE_* variables the packages read directly, outside the settings tree.
OTHER_VARIABLES = {
    "INFERLINE_CACHE_DIR": (
        "`~/.cache/inferline`",
        "Where converted model weights (and the local "
        "broker's jars) are cached. Read by `config.settings.cache_dir()`.",
    ),
    "INFERLINE_FAULT_JOIN_GATE": (
        "unset",
        "Benchmark hook: a path; the worker loads its model, then joins "
        "the group only once the file exists (bench/scaling_step.py times a "
        "scaling step apart from the model load).",
    ),
    "INFERLINE_FAULT_KILL_BEFORE_COMMIT": (
        "`0`",
        "Test hook: `N` makes the worker SIGKILL itself after "
        "its Nth transaction's records reach the broker and before the "
        "commit (worker/delivery/commit.py; tests and `make chaos`).",
    ),
    "INFERLINE_FAULT_PRODUCER_START_FAILS": (
        "`0`",
        "Test hook: the first `N` starts of the worker's transactional producer fail "
        "(worker/delivery/commit.py: each is tried again).",
    ),
    "INFERLINE_FAULT_STEP_DELAY_S": (
        "`0`",
        "Test/benchmark hook: the engine thread sleeps this many "
        "seconds before each step, a throttled worker.",
    ),
    "INFERLINE_KAFKA_PORT": (
        "`9092`",
        "The port of the local broker `scripts/kafka.sh` runs; "
        "`localhost:` that port counts as the local broker for the benchmarks, "
        "and `scripts/test.sh` points `INFERLINE_KAFKA__BOOTSTRAP_SERVERS` at it.",
    ),
    "INFERLINE_KERNEL_CHECKS": (
        "`0`",
        "`1` turns on the kernels' shape, dtype and stride assertions "
        "on CUDA tensors (always on for CPU tensors).",
    ),
}
OTHER_VARIABLE_RE = re.compile(
    r"""(?:environ(?:\.get)?\s*[(\[]|getenv\s*\()\s*["'](INFERLINE_[A-Z0-9_]+)["']"""
)
PACKAGES = ("config", "worker", "producer", "kernels")


# --------------------------------------------------------------------------- reading the source


def source_comments() -> dict[tuple[str, str], str]:
    """(class name, field) -> the comment lines right above the field, joined."""
    lines = SOURCE.read_text().splitlines()
    out = {}
    for node in ast.walk(ast.parse(SOURCE.read_text())):
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                above, i = [], stmt.lineno - 2
                while i >= 0 and lines[i].strip().startswith("#"):
                    above.insert(0, lines[i].strip().lstrip("#").strip())
                    i -= 1
                if above:
                    out[(node.name, stmt.target.id)] = " ".join(above)
    return out


def other_variables() -> set[str]:
    found = set()
    for folder in PACKAGES:
        for path in (REPO / folder).rglob("*.py"):
            found.update(OTHER_VARIABLE_RE.findall(path.read_text()))
    return found


# --------------------------------------------------------------------------- rendering


def _unwrap(annotation):
    """(inner annotation, optional?) with `X | None` unwrapped."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def type_text(annotation) -> str:
    inner, optional = _unwrap(annotation)
    if typing.get_origin(inner) is typing.Literal:
        text = " \\| ".join(f"`{v}`" for v in typing.get_args(inner))
    elif inner is SecretStr:
        text = "secret string"
    elif inner is Path:
        text = "path"
    elif inner in (str, int, float, bool):
        text = {str: "string", int: "integer", float: "number", bool: "boolean"}[inner]
    elif set(typing.get_args(inner)) == {str, int, float, bool}:
        text = "string, number or boolean"
    else:
        raise SystemExit(f"gen_config_docs: no rendering for {annotation!r}")
    return text


def bounds_text(field) -> str:
    symbols = {
        annotated_types.Ge: ("≥", "ge"),
        annotated_types.Gt: (">", "gt"),
        annotated_types.Le: ("≤", "le"),
        annotated_types.Lt: ("<", "lt"),
    }
    parts = []
    for meta in field.metadata:
        for kind, (symbol, attr) in symbols.items():
            if isinstance(meta, kind):
                parts.append(f"{symbol} {getattr(meta, attr):,}")
    return ", ".join(parts)


def default_text(field) -> str:
    value = field.get_default()
    if value is None:
        return "unset"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""` (empty)'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (int, float)):
        return f"`{value}`"
    raise SystemExit(f"gen_config_docs: no rendering for the default {value!r}")


def env(*parts: str) -> str:
    return ENV_PREFIX + ENV_DELIMITER.join(p.upper() for p in parts)


def meaning(model: type[BaseModel], key: str, name: str, comments) -> str:
    text = MEANINGS.get(key) or comments.get((model.__name__, name))
    if not text:
        raise SystemExit(
            f"gen_config_docs: no comment above {model.__name__}.{name} and no MEANINGS[{key!r}]"
        )
    return text


def rows(model: type[BaseModel], prefix: tuple[str, ...], key_prefix: str, comments) -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        key = f"{key_prefix}.{name}"
        annotation = field.annotation
        if typing.get_origin(annotation) is dict:
            sub = typing.get_args(annotation)[1]
            # Variable names are lower-cased: a per-key variable only suits models keyed by name.
            is_model = isinstance(sub, type) and issubclass(sub, BaseModel)
            per_key = (
                f" Or one variable per value: `{env(*prefix, name)}__<NAME>__<FIELD>` (see below)."
                if is_model
                else ""
            )
            values = sub.__name__ if is_model else type_text(sub)
            out.append(
                f"| `{env(*prefix, name)}` | JSON object: name → {values} | `{{}}` | "
                f"{meaning(model, key, name, comments)}{per_key} |"
            )
            continue
        if typing.get_origin(annotation) is list:
            out.append(
                f"| `{env(*prefix, name)}` | "
                f"JSON list of {type_text(typing.get_args(annotation)[0])}s | "
                f"`{field.get_default()}` | {meaning(model, key, name, comments)} |"
            )
            continue
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out += rows(
                annotation,
                (*prefix, name),
                "tenant" if annotation.__name__ == "TenantLimit" else key,
                comments,
            )
            continue
        kind = type_text(annotation)
        bounds = bounds_text(field)
        if bounds:
            kind = f"{kind}, {bounds}"
        out.append(
            f"| `{env(*prefix, name)}` | {kind} | {default_text(field)} | "
            f"{meaning(model, key, name, comments)} |"
        )
    return out


def render() -> str:
    comments = source_comments()
    head = (
        "<!-- Generated by scripts/gen_config_docs.py from config/settings.py: "
        f"""do not edit by hand. -->
# Configuration reference

Every setting of the worker (and of the `inferline` client, which reads the same `kafka` section)
comes from one pydantic-settings tree, `config/settings.py`. Set it in the environment with the
prefix `{ENV_PREFIX}` and `{ENV_DELIMITER}` between levels:

```sh
INFERLINE_KAFKA__BOOTSTRAP_SERVERS=broker-1:9092,broker-2:9092
INFERLINE_SCHEDULER__MAX_NUM_SEQS=128
INFERLINE_LIMITS__TENANTS='{{"Acme": {{"requests_per_s": 5, "tokens_per_min": 60000}}}}'
```

Names are case-insensitive. A bad value stops `inferline-worker` at start-up with exit code 2 and
one line naming the variable, e.g. `invalid setting INFERLINE_CACHE__BLOCK_SIZE: ...`.

"""
    )
    parts = [head]
    for name, field in Settings.model_fields.items():
        if name not in SECTIONS:
            raise SystemExit(f"gen_config_docs: no SECTIONS entry for {name!r}")
        parts.append(f"## `{name}`\n\n{SECTIONS[name]}\n\n")
        parts.append("| variable | type | default | meaning |\n|---|---|---|---|\n")
        parts.append("\n".join(rows(field.annotation, (name,), name, comments)) + "\n\n")
    parts.append(TENANTS_NOTE)
    parts.append(
        "## Other variables\n\nRead directly by the packages, outside the settings tree.\n\n"
    )
    parts.append("| variable | default | meaning |\n|---|---|---|\n")
    found = other_variables()
    if found != set(OTHER_VARIABLES):
        raise SystemExit(f"gen_config_docs: OTHER_VARIABLES must be exactly {sorted(found)}")
    for var in sorted(OTHER_VARIABLES):
        default, text = OTHER_VARIABLES[var]
        parts.append(f"| `{var}` | {default} | {text} |\n")
    parts.append(
        "\n`scripts/kafka.sh` (the local broker of `make kafka`) documents its own "
        "`INFERLINE_KAFKA_*` variables in its header.\n"
    )
    return "".join(parts)


TENANTS_NOTE = """### Tenant limits

`limits.default_tenant` applies to each tenant separately (every tenant gets its own buckets);
`limits.tenants` overrides it by name. A tenant name given inside a variable name is lower-cased
(`INFERLINE_LIMITS__TENANTS__ACME__REQUESTS_PER_S=5` limits the tenant `acme`), while tenant
names are matched case-sensitively: for a name with capitals, set `INFERLINE_LIMITS__TENANTS` to a
JSON object instead.

"""


def main() -> int:
    return cli(OUT, render, __doc__.splitlines()[0], "gen_config_docs.py")


if __name__ == "__main__":
    sys.exit(main())
