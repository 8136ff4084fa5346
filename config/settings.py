"""The one settings tree of inferline, from ``INFERLINE_`` variables with ``__`` between levels
(docs/configuration.md); ``load_settings()`` names the variable behind a bad value.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Re-exported: they need no pydantic, so the kernels and the loader's callers can do without.
from inferline.config.paths import bundled_model_path, cache_dir  # noqa: F401

ENV_PREFIX = "INFERLINE_"
ENV_DELIMITER = "__"


# Client settings the worker sets itself, for its guarantees or from its own settings: a
# passthrough may not change them (a client's own choices, the committer's linger.ms, also win).
RESERVED_LIBRDKAFKA = frozenset(
    "bootstrap.servers client.id security.protocol sasl.mechanism sasl.mechanisms sasl.username "
    "sasl.password ssl.ca.location ssl.certificate.location ssl.key.location transactional.id "
    "enable.idempotence isolation.level group.id group.protocol group.instance.id "
    "enable.auto.commit enable.auto.offset.store share.acknowledgement.mode "
    "allow.auto.create.topics oauth_cb sasl.oauthbearer.method sasl.oauthbearer.config".split()
)
RESERVED_AIOKAFKA = frozenset(
    "bootstrap_servers client_id security_protocol sasl_mechanism sasl_plain_username "
    "sasl_plain_password ssl_context transactional_id enable_idempotence acks isolation_level "
    "group_id enable_auto_commit sasl_oauth_token_provider".split()
)


def check_passthrough(value: dict, reserved: frozenset, library: str) -> None:
    owned = sorted(set(value) & reserved)
    if owned:
        raise ValueError(
            f"{', '.join(owned)}: set by inferline itself (its own setting or a guarantee), "
            f"not through the {library} passthrough"
        )


def librdkafka_refusal(value: dict) -> None:
    """Raise if librdkafka refuses `value` (an unknown name, a bad value): a client is made with
    no broker to reach and thrown away."""
    from confluent_kafka import KafkaException, Producer

    try:
        Producer({**value, "bootstrap.servers": "", "log_level": 0})
    except KafkaException as exc:
        raise ValueError(f"librdkafka refuses it: {exc.args[0].str()}") from None


def aiokafka_common_options() -> set[str]:
    """Keyword arguments every aiokafka client the project makes accepts."""
    import inspect

    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient

    clients = (AIOKafkaProducer, AIOKafkaConsumer, AIOKafkaAdminClient)
    names = [set(inspect.signature(c.__init__).parameters) for c in clients]
    return set.intersection(*names) - {"self", "loop"}


class KafkaSettings(BaseModel):
    bootstrap_servers: str = "localhost:9092"
    request_topic: str = "llm.requests"
    cancel_topic: str = "llm.cancel"
    dlq_topic: str = "llm.requests.dlq"
    # Replies go only to existing topics starting with this (never the worker's own nor `__` ones);
    # other reply topics are dead-lettered. "" allows any other topic.
    reply_topic_prefix: str = "inferline.reply."
    # Seconds a reply topic found missing stays missing: its requests are dead-lettered unchecked.
    missing_reply_topic_ttl_s: float = Field(10.0, gt=0)
    # Who a request is from. `body`: its `tenant` field, trusted. `topic`: the tenant's own topic
    # `<request_topic>.<tenant>`, kept to it by Kafka ACLs (docs/security.md).
    tenancy: Literal["body", "topic"] = "body"
    # How far back the cancel topic is read at start-up, and how long cancels are remembered: the
    # longest `timeout_s` a request may ask for. Keep the cancel topic compacted.
    cancel_lookback_s: float = Field(86_400.0, gt=0)
    group_id: str = "inferline-workers"
    # `group`: a consumer group, exactly one final result per request. `share`: a share group
    # (KIP-932, broker 4.2+), at least once, body tenancy only (docs/operations.md).
    intake: Literal["group", "share"] = "group"
    # Share mode: a record delivered more often (one hand-off of overflow not counted) goes to the
    # dead-letter topic; lowered to two below the broker's group.share.delivery.count.limit.
    max_deliveries: int = Field(4, ge=1)
    # Share mode: how long a taken record stays locked to its worker. Unset: the request timeout
    # plus a margin. Capped by the broker's group.share.max.record.lock.duration.ms (60 s default).
    share_lock_ms: int | None = Field(None, ge=1_000)
    # Share mode: share consumers per worker at most (one whose requests still run cannot poll).
    share_consumers: int = Field(8, ge=1, le=64)
    # Static membership: a worker restarted within the session timeout keeps its partitions.
    group_instance_id: str | None = None
    client_id: str = "inferline"
    # Group mode: the group's `consumer.session.timeout.ms`, set by the worker (KIP-848 keeps it on
    # the broker, within its group.consumer.min/max.session.timeout.ms; refused: the broker's).
    session_timeout_ms: int = Field(10_000, ge=1_000)
    # No request message over this size is decoded (the broker default is 1 MiB).
    max_message_bytes: int = Field(1_048_576, ge=1_024)
    # A reply topic's `max.message.bytes` must be at least this, else its requests are dead-lettered
    # (a topic refusing a transaction's markers would wedge it).
    min_reply_message_bytes: int = Field(65_536, ge=100)
    # Seconds a final result failing for a passing cause is retried before it is dead-lettered;
    # also how long a request waits on a reply-topic lookup the broker does not answer.
    final_retry_s: float = Field(300.0, ge=1.0)
    # Tokens made within this interval travel in one `tokens` event (the first at once).
    flush_interval_ms: float = Field(100.0, ge=0)
    # Replies waiting for the broker; past this, intake pauses instead of memory growing.
    max_pending_replies: int = Field(10_000, ge=10)
    # The broker aborts a dead worker's open transaction after this; readers of its reply partitions
    # wait that long, so keep it short.
    transaction_timeout_ms: int = Field(10_000, ge=1_000)
    # The worker begins at most one transaction per interval (0: no wait): the finals of every
    # partition it owns share one.
    transaction_interval_ms: float = Field(250.0, ge=0)
    # The broker's `offset.metadata.max.bytes`: the offset ledger of a commit must fit in it.
    offset_metadata_max_bytes: int = Field(4096, ge=64)
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    # The password read from a file (a mounted secret) instead.
    sasl_password_file: Path | None = None
    # OAUTHBEARER (docs/security.md): an OIDC client-credentials token from this endpoint, for
    # oauth_client_id with its secret (from the file, a mounted secret, or literal) and scope,
    # fetched at start-up (a refusal stops it) and again at 80% of its lifetime.
    oauth_token_endpoint_url: str | None = None
    oauth_client_id: str | None = None
    oauth_client_secret: SecretStr | None = None
    oauth_client_secret_file: Path | None = None
    oauth_scope: str | None = None
    # SASL extensions sent with the token (KIP-342), e.g. {"logicalCluster": "lkc-abc"}.
    oauth_extensions: dict[str, str] = {}
    # Instead of the endpoint: `module:function`, a callable with no arguments returning
    # (token, expiry in Unix seconds), for cloud-specific signers (MSK IAM, Event Hubs, ...).
    oauth_token_provider: str | None = None
    ssl_cafile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    # The Python client and the gateway create their reply topics when missing and delete those
    # they made (CREATE and DELETE under the reply prefix). false: reply topics are made ahead
    # (`inferline topics create --reply-topic`) and named (the client's reply_topic,
    # INFERLINE_GATEWAY__REPLY_TOPIC): nothing is created or deleted at run time, READ suffices.
    create_reply_topics: bool = True
    # Replicas of every topic inferline creates (`inferline topics create`, the clients' and the
    # gateway's reply topics, the gateway's state topic); unset: the broker's
    # default.replication.factor.
    replication_factor: int | None = Field(None, ge=1)
    # The `min.insync.replicas` of those topics; unset: the broker's.
    min_insync_replicas: int | None = Field(None, ge=1)
    # librdkafka settings inferline does not model, by librdkafka's names, for its confluent-kafka
    # clients (group intake, the transactional producer of finals, share intake, admin), e.g.
    # {"socket.keepalive.enable": true}. Checked at start-up by librdkafka (an unknown name or bad
    # value stops the worker); a consumer-only one is ignored, with librdkafka's warning, by the
    # producers. Refused: what inferline sets from its own settings or for its guarantees
    # (bootstrap, security, ids, idempotence, isolation, group, commits, topic creation); a
    # setting one client sets itself (the transactional producer's linger.ms) keeps its value.
    librdkafka: dict[str, str | int | float | bool] = {}
    # aiokafka keyword arguments for every aiokafka client (reply events, cancels, lookups, the
    # Python client and the gateway): only those all of them take, e.g. request_timeout_ms,
    # retry_backoff_ms, metadata_max_age_ms, connections_max_idle_ms; the ones inferline sets
    # (acks, enable_idempotence, isolation_level, ...) are refused.
    aiokafka: dict[str, str | int | float | bool] = {}

    @field_validator("librdkafka")
    @classmethod
    def _known_to_librdkafka(cls, value: dict) -> dict:
        check_passthrough(value, RESERVED_LIBRDKAFKA, "librdkafka")
        if value:
            librdkafka_refusal(value)
        return value

    @field_validator("aiokafka")
    @classmethod
    def _known_to_aiokafka(cls, value: dict) -> dict:
        check_passthrough(value, RESERVED_AIOKAFKA, "aiokafka")
        unknown = sorted(set(value) - aiokafka_common_options())
        if unknown:
            raise ValueError(
                f"{', '.join(unknown)}: not a keyword argument of every aiokafka client the "
                "project makes (producer, consumer, admin)"
            )
        return value

    @field_validator("oauth_token_provider")
    @classmethod
    def _importable(cls, value: str | None) -> str | None:
        if value:
            from inferline.config.oauth import load_callable

            try:
                load_callable(value)
            except (ImportError, AttributeError, ValueError) as exc:
                raise ValueError(f"no callable {value!r}: {exc}") from None
        return value

    @model_validator(mode="after")
    def _oauth_complete(self) -> "KafkaSettings":
        if self.sasl_mechanism != "OAUTHBEARER" or self.oauth_token_provider:
            return self
        missing = [
            name
            for name, value in (
                ("oauth_token_endpoint_url", self.oauth_token_endpoint_url),
                ("oauth_client_id", self.oauth_client_id),
                (
                    "oauth_client_secret or oauth_client_secret_file",
                    self.oauth_client_secret or self.oauth_client_secret_file,
                ),
            )
            if not value
        ]
        if missing:
            raise ValueError(
                "sasl_mechanism OAUTHBEARER needs oauth_token_provider or " + ", ".join(missing)
            )
        return self

    @model_validator(mode="after")
    def _share_reads_one_topic(self) -> "KafkaSettings":
        if self.intake == "share" and self.tenancy != "body":
            raise ValueError("intake=share reads one request topic: tenancy must be body")
        return self

    @field_validator("reply_topic_prefix")
    @classmethod
    def _topic_chars(cls, value: str) -> str:
        if value and not all(c.isascii() and (c.isalnum() or c in "._-") for c in value):
            raise ValueError(
                "must be empty or the start of a topic name (a-z, A-Z, 0-9, '.', '_', '-')"
            )
        return value

    def password(self) -> str | None:
        if self.sasl_password_file is not None:
            return self.sasl_password_file.read_text().strip()
        return self.sasl_password.get_secret_value() if self.sasl_password else None

    def oauth(self):
        """The process's OAUTHBEARER token provider for these settings, holding a token (the first
        is fetched here: an OAuthTokenError names the endpoint and client id)."""
        from inferline.config.oauth import shared_provider

        return shared_provider(self)

    def client_options(self) -> dict:
        """aiokafka options of one of the worker's clients, with its client id."""
        return {**self.connection_options(), "client_id": self.client_id}

    def librdkafka_config(self) -> dict:
        """client_options() in librdkafka's names (confluent-kafka)."""
        config = {
            "bootstrap.servers": self.bootstrap_servers,
            "security.protocol": self.security_protocol,
            "client.id": self.client_id,
        }
        if self.sasl_mechanism == "OAUTHBEARER":
            config.update({"sasl.mechanism": "OAUTHBEARER", "oauth_cb": self.oauth().oauth_cb})
        elif self.sasl_mechanism:
            config.update(
                {
                    "sasl.mechanism": self.sasl_mechanism,
                    "sasl.username": self.sasl_username,
                    "sasl.password": self.password(),
                }
            )
        for name, path in (
            ("ssl.ca.location", self.ssl_cafile),
            ("ssl.certificate.location", self.ssl_certfile),
            ("ssl.key.location", self.ssl_keyfile),
        ):
            if path is not None:
                config[name] = str(path)
        return {**config, **self.librdkafka}

    def connection_options(self) -> dict:
        """aiokafka options shared by every client (servers and security): the one place Kafka
        client options are built."""
        opts: dict = {
            "bootstrap_servers": self.bootstrap_servers,
            "security_protocol": self.security_protocol,
        }
        if self.sasl_mechanism == "OAUTHBEARER":
            opts.update(sasl_mechanism="OAUTHBEARER", sasl_oauth_token_provider=self.oauth())
        elif self.sasl_mechanism:
            opts.update(
                sasl_mechanism=self.sasl_mechanism,
                sasl_plain_username=self.sasl_username,
                sasl_plain_password=self.password(),
            )
        if self.security_protocol in ("SSL", "SASL_SSL"):
            from aiokafka.helpers import create_ssl_context

            opts["ssl_context"] = create_ssl_context(
                cafile=self.ssl_cafile, certfile=self.ssl_certfile, keyfile=self.ssl_keyfile
            )
        return {**opts, **self.aiokafka}


class ModelSettings(BaseModel):
    # A Hugging Face model folder or a .gguf file; empty: the bundled SmolLM2-135M-Instruct GGUF.
    path: str = ""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # `dummy`: random weights from the model's config, for speed work without weights.
    load_format: Literal["auto", "dummy"] = "auto"
    max_model_len: int = Field(2048, ge=16)
    # CPU: torch's intra-op threads (0: one per core); one fewer leaves a core for Kafka under load.
    cpu_threads: int = Field(0, ge=0)
    # `auto`: Triton on CUDA, the C kernel for fp32 on the CPU, else PyTorch. `triton` on a CPU runs
    # the interpreter (tests). An explicit choice this machine cannot run stops start-up.
    attention_backend: Literal["auto", "triton", "cpu", "torch"] = "auto"
    # CPU fp32 linear layers: `c` (batch-invariant) and `onednn` pack the weights at load (a second
    # copy); `auto` times both on the model and keeps the faster (docs/benchmarks.md).
    cpu_linear: Literal["auto", "c", "onednn", "torch"] = "auto"
    # `false`: `auto` picks by rule (`c` on x86 with AVX2 but no AVX-512, else `onednn`).
    cpu_linear_calibrate: bool = True
    # `auto`: the `c` GEMM keeps a weight as 8-bit codes where those are exact (GGUF Q4_1, Q8_0,
    # ...): the same results from a third of the bytes. `off`: fp32 always.
    cpu_weight_codes: Literal["auto", "off"] = "auto"
    # `auto`: on CUDA the decoder's linear layers keep an FP8 checkpoint's codes, and a GGUF's
    # exact levels, as 8-bit codes for the W8A16 Triton kernel; an FP8 checkpoint's MoE experts
    # stay codes for the fused-MoE kernel's W8A16 variant. `off`: dequantized to `dtype`.
    gpu_weight_codes: Literal["auto", "off"] = "auto"
    # CPU fp32 RMSNorm, SiLU-and-mul, rope with the K/V store: `auto` C kernels, `torch` PyTorch.
    cpu_fused_ops: Literal["auto", "torch"] = "auto"
    # Decode-only steps padded to a bucket on static buffers: `on` captures a CUDA graph per bucket
    # (CUDA, Triton attention), `eager` runs them uncaptured; `auto`: `on` where it can, else `off`.
    cuda_graphs: Literal["auto", "on", "eager", "off"] = "auto"


class CacheSettings(BaseModel):
    block_size: int = Field(16, ge=1)
    kv_memory_gb: float = Field(1.0, gt=0)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    # When set, overrides both budgets.
    num_blocks: int | None = Field(None, ge=1)
    # Reuse the K/V of cached full blocks (shared system prompts, chat turns, recomputes).
    enable_prefix_caching: bool = True
    # K/V element type. `auto`: the model's. `float16` (CPU): half the memory and bytes read, K/V
    # rounded to 11 bits (greedy text may differ from fp32's).
    dtype: Literal["auto", "float16"] = "auto"

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError("must be a power of two")
        return value


class SchedulerSettings(BaseModel):
    policy: Literal["continuous", "static"] = "continuous"
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(512, ge=16)
    max_waiting: int = Field(256, ge=1)
    # Requests of this priority or worse are background work (batches send 100), throttled beside
    # better ones (docs/batch.md, "Priorities"). Past limits.max_priority: no background class.
    background_priority: int = 100
    # Background tokens per step while foreground work runs or waits.
    background_max_tokens: int = Field(32, ge=1)
    # Background tokens per step within background_quiet_s of foreground work (0: no bound).
    background_alone_max_tokens: int = Field(0, ge=0)
    # Seconds without foreground work after which background_alone_max_tokens lapses.
    background_quiet_s: float = Field(10.0, ge=0)
    # Within a priority class, seats and step tokens go to tenants in proportion to these
    # weights (docs/operations.md, "Fair share between tenants"); JSON, e.g. {"batch": 0.5}.
    tenant_weights: dict[str, float] = {}
    # The weight of every tenant not in tenant_weights (below 1: unlisted names count for less).
    default_tenant_weight: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _positive_weights(self) -> "SchedulerSettings":
        if any(not w > 0 for w in self.tenant_weights.values()):
            raise ValueError("tenant_weights must be positive")
        return self


class LaneSettings(BaseModel):
    # Group mode: requests read past the waiting pool's room wait in per-tenant lanes in memory, so
    # that intake reads on past one tenant's backlog to the next tenant's records
    # (docs/operations.md, "Lanes"); at most this many in all. 0: no lanes, intake pauses when the
    # pool is full.
    max_records: int = Field(1024, ge=0)
    # The lanes' bytes at most, counted as each record's key and value twice (the record and the
    # request decoded from it) plus 1 KiB: an estimate of their memory.
    max_bytes: int = Field(64 * 2**20, ge=0)


class EngineSettings(BaseModel):
    # Schedule and launch step N+1 while step N runs, hiding the host's work per step behind the
    # device's (docs/architecture.md, "The engine step"); `auto`: on with CUDA, off on the CPU.
    overlap: Literal["auto", "on", "off"] = "auto"


class SpeculativeSettings(BaseModel):
    # `ngram`: prompt-lookup drafts for greedy requests, verified in the same step; same output,
    # more tokens per step on repetitive text (docs/operations.md, "Speculative decoding").
    method: Literal["none", "ngram"] = "none"
    # Drafts per sequence and step, at most.
    num_tokens: int = Field(4, ge=1, le=32)
    # The longest run of last tokens looked up.
    prompt_lookup_max: int = Field(4, ge=1)
    # The shortest run looked up (1: more drafts, fewer accepted).
    prompt_lookup_min: int = Field(2, ge=1)
    # No drafts at this batch size or more (rejected drafts cost most there); unset: any size.
    disable_by_batch_size: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _lookup_range(self) -> "SpeculativeSettings":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        return self


class StructuredSettings(BaseModel):
    # Seconds a grammar has to compile from its arrival, queueing included; past it, rejected.
    compile_timeout_s: float = Field(5.0, gt=0)
    # Grammars compiled at once; one tenant holds at most compile_threads - 1 of them.
    compile_threads: int = Field(2, ge=1, le=32)
    # Compile in child processes, so an overdue compile is killed; off: it runs to its end.
    compile_processes: bool = True
    # Compiled grammars kept for reuse, in bytes; least recently used go first.
    cache_bytes: int = Field(256 * 2**20, ge=0)
    # A request whose token mask takes longer than this 3 steps in a row ends with `error`.
    mask_budget_ms: float = Field(10.0, gt=0)


class TenantLimit(BaseModel):
    requests_per_s: float | None = Field(None, gt=0)
    tokens_per_min: float | None = Field(None, gt=0)
    burst_requests: float | None = Field(None, gt=0)
    min_priority: int | None = Field(None, ge=-1000, le=1000)
    max_priority: int | None = Field(None, ge=-1000, le=1000)

    @model_validator(mode="after")
    def _priority_range(self) -> "TenantLimit":
        if (
            None not in (self.min_priority, self.max_priority)
            and self.min_priority > self.max_priority
        ):
            raise ValueError("min_priority must not exceed max_priority")
        return self


class LimitsSettings(BaseModel):
    # max_tokens at most (more is rejected naming it); a request without one gets what the model
    # length leaves after its prompt, at most this (and max_request_tokens / n).
    max_tokens_cap: int = Field(1024, ge=1)
    # Tokens a request may ask for over all its samples (n x max_tokens); more is rejected.
    max_request_tokens: int = Field(4096, ge=1)
    default_timeout_s: float = Field(600.0, gt=0)
    default_tenant: TenantLimit = TenantLimit()
    tenants: dict[str, TenantLimit] = {}
    overload_reject_after_s: float | None = Field(None, gt=0)
    # Best (lowest) `priority` of a tenant without its own range; 0: none outranks the default.
    min_priority: int = Field(0, ge=-1000, le=1000)
    # Worst (highest) `priority` of such a tenant; larger ones are lowered to it.
    max_priority: int = Field(1000, ge=-1000, le=1000)

    @model_validator(mode="after")
    def _priority_range(self) -> "LimitsSettings":
        if self.min_priority > self.max_priority:
            raise ValueError("min_priority must not exceed max_priority")
        return self


class HttpSettings(BaseModel):
    host: str = "0.0.0.0"
    port: int = Field(8080, ge=0, le=65535)
    # /healthz fails when the engine loop has not ticked for this long.
    stall_threshold_s: float = Field(30.0, gt=0)


class LogSettings(BaseModel):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: Literal["auto", "json", "console"] = "auto"


class WorkerSettings(BaseModel):
    # Shown in `started` events; defaults to host:pid.
    name: str | None = None
    drain_timeout_s: float = Field(30.0, ge=0)


class GatewaySettings(BaseModel):
    host: str = "0.0.0.0"
    # `inferline gateway --port` overrides it; 0 picks a free one.
    port: int = Field(8000, ge=0, le=65535)
    # API key -> tenant (JSON). Empty, and no `api_keys_file`: no keys asked, one default tenant.
    api_keys: dict[str, str] = {}
    # The same JSON object from a file (a mounted secret), merged in.
    api_keys_file: Path | None = None
    # Tenants whose keys may set `priority` (still clamped by the worker); others' is dropped.
    priority_tenants: list[str] = []
    # The model /v1/models lists; a request naming another gets 404.
    model_name: str = "SmolLM2-135M-Instruct"
    # Each request's deadline (`timeout_s`); past it the answer is 504.
    request_timeout_s: float = Field(600.0, gt=0, le=86_400)
    # Seconds the 429 answers ask a client to wait (`Retry-After`).
    retry_after_s: int = Field(1, ge=0)
    # Partitions of each reply topic the gateway creates (one per tenant per instance).
    reply_partitions: int = Field(4, ge=1)
    # Where a reasoning model's thinking goes (as vLLM's --reasoning-parser): `think` (Qwen3:
    # an answer that opens with <think> ... </think>) or `deepseek_r1` (the template opened it:
    # the answer starts inside) put it in the chat answer's `reasoning_content`; empty: no split.
    reasoning_parser: Literal["", "think", "deepseek_r1"] = ""
    # The format the model writes tool calls in (as vLLM's --tool-call-parser): `hermes`
    # (<tool_call>{"name", "arguments"}</tool_call>: Qwen2.5, Hermes) or `llama3_json` (bare
    # {"name", "parameters"}: Llama 3.x); also the format of the fallback prompt that shows a
    # model the tools where its chat template does not (docs/gateway.md, "Tool calling").
    tool_call_parser: Literal["hermes", "llama3_json"] = "hermes"
    # One reply topic for every gateway replica, `<reply prefix>[<tenant>.]<reply_topic>`, read
    # from its end by each (made ahead with `inferline topics create --reply-topic`, or at start
    # when INFERLINE_KAFKA__CREATE_REPLY_TOPICS allows; never deleted). Empty: one per replica
    # (and tenant), made at start and deleted at stop.
    reply_topic: str = Field("", pattern=r"^[A-Za-z0-9._-]*$", max_length=64)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_DELIMITER, extra="ignore"
    )

    kafka: KafkaSettings = KafkaSettings()
    model: ModelSettings = ModelSettings()
    cache: CacheSettings = CacheSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    lanes: LaneSettings = LaneSettings()
    engine: EngineSettings = EngineSettings()
    speculative: SpeculativeSettings = SpeculativeSettings()
    structured: StructuredSettings = StructuredSettings()
    limits: LimitsSettings = LimitsSettings()
    http: HttpSettings = HttpSettings()
    log: LogSettings = LogSettings()
    worker: WorkerSettings = WorkerSettings()
    gateway: GatewaySettings = GatewaySettings()


class SettingsError(SystemExit):
    """A bad setting: exits the process with one line naming the variable."""


def env_name(loc: tuple) -> str:
    """The environment variable behind a pydantic error location."""
    parts = [str(p) for p in loc if not str(p).startswith("function-")]
    return ENV_PREFIX + ENV_DELIMITER.join(p.upper() for p in parts)


def load_settings(**overrides) -> Settings:
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise SettingsError(f"invalid setting {env_name(err['loc'])}: {err['msg']}") from None


def is_local_broker(settings: Settings) -> bool:
    """The broker scripts/kafka.sh runs here (on INFERLINE_KAFKA_PORT, 9092 by default)."""
    port = os.environ.get("INFERLINE_KAFKA_PORT", "9092")
    return settings.kafka.bootstrap_servers in (f"localhost:{port}", f"127.0.0.1:{port}")
