"""The worker's Prometheus metrics, on a registry per Worker (tests run several in one process)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets from 5 ms to 10 min: queue time spans that range under load.
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_STEP = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
# A gap between two tokens is one decode step or a few: finer than _LATENCY where steps are.
_GAP = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15)
_GAP += (0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10, 30)


# Tenants with a label of their own, at most; the rest share OTHER_TENANTS, which no tenant name
# can be (contract.schema.TENANT_PATTERN has no parentheses).
TENANT_LABELS = 10
OTHER_TENANTS = "(other)"


class TenantLabels:
    """Which tenants get their own `tenant` label: at most `limit`, the heaviest by requests in the
    pool. A named tenant keeps its label, idle or not, until a tenant with work needs the place:
    an idle one gives way first, a busy one only to a tenant with twice its requests (labels churn
    no faster than the heavy tenants change, and a counter's series does not vanish between one
    tenant's requests)."""

    def __init__(self, limit: int = TENANT_LABELS):
        self.limit = limit
        self.named: set[str] = set()

    def update(self, load: dict[str, int]) -> set[str]:
        """Relabel for `load` (requests in the pool by tenant); returns the labels dropped."""
        dropped: set[str] = set()
        waiting = (t for t in load if load[t] and t not in self.named)
        for tenant in sorted(waiting, key=load.get)[::-1]:
            if len(self.named) >= self.limit:
                idle = sorted(t for t in self.named if not load.get(t))
                lightest = idle[0] if idle else min(self.named, key=load.get)
                if not idle and load[tenant] < 2 * load[lightest]:
                    break  # sorted heaviest first: nobody after it is heavier
                self.named.remove(lightest)
                dropped.add(lightest)
            self.named.add(tenant)
        return dropped - self.named

    def label(self, tenant: str) -> str:
        return tenant if tenant in self.named else OTHER_TENANTS


def priority_label(priority: int) -> str:
    """Priorities are producer-chosen ints: clamp the label to bound cardinality."""
    if priority < -10:
        return "lt-10"
    if priority > 10:
        return "gt10"
    return str(priority)


def length_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (as vLLM's token-count histograms)."""
    out, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return tuple(out)
            out.append(step * scale)
        scale *= 10


class Metrics:
    """The worker's metrics; the latency ones and the token counts carry `model_name`, the name
    clients call the model by (INFERLINE_GATEWAY__MODEL_NAME: what /v1/models lists)."""

    def __init__(self, model_name: str = "", max_model_len: int = 2048) -> None:
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "inferline_requests",
            "Requests finished, by outcome (finish_reason)",
            ["outcome"],
            registry=r,
        )
        self.rejections = Counter(
            "inferline_rejections", "Requests rejected, by error code", ["reason"], registry=r
        )
        self.dead_letters = Counter(
            "inferline_dead_letters", "Messages sent to the dead-letter topic", registry=r
        )
        self.reply_topic_refusals = Counter(
            "inferline_reply_topic_refusals",
            "Requests dead-lettered for a reply topic the worker may not write to "
            "or that does not exist",
            registry=r,
        )
        self.cancels = Counter("inferline_cancels_received", "Cancel messages read", registry=r)
        self.tokens_generated = Counter(
            "inferline_tokens_generated", "Output tokens generated", ["model_name"], registry=r
        )
        self.prompt_tokens = Counter(
            "inferline_prompt_tokens",
            "Prompt tokens of requests that got their first token",
            ["model_name"],
            registry=r,
        )
        self.preemptions = Counter(
            "inferline_preemptions", "Sequences preempted by the scheduler", registry=r
        )
        self.prefix_queries = Counter(
            "inferline_prefix_cache_queries",
            "Tokens of admitted sequences looked up in the prefix cache",
            registry=r,
        )
        self.prefix_hits = Counter(
            "inferline_prefix_cache_hits",
            "Tokens found in the prefix cache (their K/V reused, not computed)",
            registry=r,
        )
        self.spec_drafts = Counter(
            "inferline_spec_draft_tokens",
            "Speculative draft tokens computed (INFERLINE_SPECULATIVE__METHOD)",
            registry=r,
        )
        self.spec_accepted = Counter(
            "inferline_spec_accepted_tokens",
            "Of those, drafts accepted: tokens gained beyond one per sequence and step",
            registry=r,
        )
        self.forked_samples = Counter(
            "inferline_forked_samples",
            "Samples 1..n-1 of requests with n > 1, started on the prompt's shared "
            "KV blocks (the prompt computed once)",
            registry=r,
        )
        self.queue_time = self._hist("inferline_queue_time_seconds", "Receipt to first schedule")
        self.ttft = self._hist("inferline_ttft_seconds", "Receipt to first token")
        self.itl = self._hist(
            "inferline_inter_token_latency_seconds",
            "Mean time between tokens of one request (one sample per request)",
        )
        self.e2e = self._hist("inferline_e2e_seconds", "Receipt to done")
        self._add_user_latency(max_model_len)
        self.running = Gauge(
            "inferline_running_requests", "Requests in the running batch", registry=r
        )
        self.waiting = Gauge(
            "inferline_waiting_requests", "Requests waiting for the engine", registry=r
        )
        self.kv_cache_usage = Gauge(
            "inferline_kv_cache_usage", "Fraction of KV cache blocks in use (0..1)", registry=r
        )
        self.kv_cache_waste = Gauge(
            "inferline_kv_cache_waste",
            "Fraction of the KV slots in use that hold no token: the empty end of each "
            "sequence's last block, blocks taken for rejected drafts (0..1)",
            registry=r,
        )
        self.kernel_backend = Gauge(
            "inferline_kernel_backend_info",
            "1 for each kernel backend the model runs (kernels/backends.py); "
            "how: set (explicit or the rule), timed or cached (auto's calibration)",
            ["kind", "backend", "how"],
            registry=r,
        )
        self.batch_size = Gauge(
            "inferline_batch_size", "Sequences in the last engine step", registry=r
        )
        self.batched_tokens = Gauge(
            "inferline_batched_tokens", "Tokens in the last engine step", registry=r
        )
        self.iteration = Histogram(
            "inferline_iteration_seconds", "Engine step latency", buckets=_STEP, registry=r
        )
        self.send_failures = Counter(
            "inferline_reply_send_failures", "Reply / dead-letter sends that failed", registry=r
        )
        self.pending_replies = Gauge(
            "inferline_pending_replies", "Reply events not yet acked by the broker", registry=r
        )
        self.consumer_lag = Gauge(
            "inferline_consumer_lag",
            "Records behind the high watermark, per partition",
            ["topic", "partition"],
            registry=r,
        )
        self.partition_backlog = Gauge(
            "inferline_partition_backlog",
            "Records of an owned request partition not finished: unread up to its end offset, "
            "plus taken and unfinished (finished ones above a slow request do not count)",
            ["topic", "partition"],
            registry=r,
        )
        self.redeliveries = Counter(
            "inferline_redeliveries",
            "Records read again whose result is final already (the offset ledger "
            "lists them), skipped",
            ["outcome"],
            registry=r,
        )
        self.transactions = Counter(
            "inferline_transactions",
            "Transactions of final results, by outcome "
            "(committed; aborted: retried; lost: the producer was replaced)",
            ["outcome"],
            registry=r,
        )
        self.transaction_seconds = Histogram(
            "inferline_transaction_seconds",
            "Begin to commit of one transaction of final results",
            buckets=_STEP,
            registry=r,
        )
        self.dead_letters_lost = Counter(
            "inferline_dead_letters_lost",
            "Dead letters the DLQ would not take within their budget; their offsets advanced",
            registry=r,
        )
        self.producer_start_failures = Counter(
            "inferline_producer_start_failures",
            "Transactional producers that failed to start (each is tried again)",
            registry=r,
        )
        self.producer_renewals = Counter(
            "inferline_producer_renewals",
            "Transactional producers replaced after writing to MAX_PRODUCER_TOPICS reply topics "
            "(librdkafka keeps every topic's metadata)",
            registry=r,
        )
        self.consumer_restarts = Counter(
            "inferline_consumer_restarts",
            "Group consumers replaced after the broker refused them (a static member's "
            "instance id still held by its killed predecessor's session)",
            registry=r,
        )
        self.intake_paused = Gauge(
            "inferline_intake_paused", "1 while intake is paused (backpressure)", registry=r
        )
        self._add_tenants()

    def _add_tenants(self) -> None:
        """Per-tenant load and tokens, labelled by TenantLabels (docs/operations.md, "Fair
        share between tenants")."""
        r, labels = self.registry, ["tenant"]
        self.tenant_waiting = Gauge(
            "inferline_tenant_waiting_requests",
            "Sequences waiting in the engine, by tenant (the heaviest; `(other)`: the rest)",
            labels,
            registry=r,
        )
        self.tenant_running = Gauge(
            "inferline_tenant_running_requests",
            "Sequences in the running batch, by tenant (the heaviest; `(other)`: the rest)",
            labels,
            registry=r,
        )
        self.tenant_tokens = Counter(
            "inferline_tenant_tokens_generated",
            "Output tokens generated, by tenant (the heaviest; `(other)`: the rest)",
            labels,
            registry=r,
        )
        self.tenant_lane = Gauge(
            "inferline_tenant_lane_requests",
            "Requests read past the waiting pool, parked in their tenant's lane (the heaviest; "
            "`(other)`: the rest)",
            labels,
            registry=r,
        )
        self.lane_bytes = Gauge(
            "inferline_lane_bytes",
            "The lanes' bytes as INFERLINE_LANES__MAX_BYTES counts them",
            registry=r,
        )
        # not attributes: tests walk those
        self._tenant_labels = {"labels": TenantLabels(), "lanes": TenantLabels()}

    def observe_tenants(self, load: dict[str, tuple[int, int]], tokens: dict[str, int]) -> None:
        """One step's (waiting, running) sequences and generated tokens by tenant."""
        labels: TenantLabels = self._tenant_labels["labels"]
        # A tenant whose last request ended in this step keeps its label for the step's tokens.
        counts = {t: 1 for t in tokens} | {t: w + r for t, (w, r) in load.items() if w + r}
        for tenant in labels.update(counts):
            for family in (self.tenant_waiting, self.tenant_running, self.tenant_tokens):
                family.remove(tenant)
        for tenant, num in tokens.items():
            self.tenant_tokens.labels(labels.label(tenant)).inc(num)
        sums: dict[str, list[int]] = {t: [0, 0] for t in (*labels.named, OTHER_TENANTS)}
        for tenant, (waiting, running) in load.items():
            row = sums[labels.label(tenant)]
            row[0] += waiting
            row[1] += running
        for label, (waiting, running) in sums.items():
            self.tenant_waiting.labels(label).set(waiting)
            self.tenant_running.labels(label).set(running)

    def observe_lanes(self, depths: dict[str, int], num_bytes: int) -> None:
        """Parked requests by tenant, and the lanes' bytes."""
        labels: TenantLabels = self._tenant_labels["lanes"]
        for tenant in labels.update(depths):
            self.tenant_lane.remove(tenant)
        sums = dict.fromkeys((*labels.named, OTHER_TENANTS), 0)
        for tenant, depth in depths.items():
            sums[labels.label(tenant)] += depth
        for label, depth in sums.items():
            self.tenant_lane.labels(label).set(depth)
        self.lane_bytes.set(num_bytes)

    def _hist(self, name: str, doc: str) -> Histogram:
        labels = ["model_name", "priority"]
        return Histogram(name, doc, labels, buckets=_LATENCY, registry=self.registry)

    def _model_hist(self, name: str, doc: str, buckets) -> Histogram:
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)

    def _add_user_latency(self, max_model_len: int) -> None:
        """Latency as the user feels it: before receipt, between tokens; request sizes."""
        self.time_in_kafka = self._model_hist(
            "inferline_time_in_kafka_seconds",
            "Record timestamp to receipt (0 for a timestamp after receipt)",
            _LATENCY,
        )
        self.e2e_ttft = self._model_hist(
            "inferline_e2e_ttft_seconds",
            "Record timestamp (or receipt, if earlier) to first token",
            _LATENCY,
        )
        self.token_gap = self._model_hist(
            "inferline_inter_token_gap_seconds",
            "Time between a sample's consecutive engine steps with tokens, one per step",
            _GAP,
        )
        lengths = length_buckets(max_model_len)
        self.request_prompt_tokens = self._model_hist(
            "inferline_request_prompt_tokens", "Prompt tokens per finished request", lengths
        )
        self.request_generation_tokens = self._model_hist(
            "inferline_request_generation_tokens",
            "Output tokens per finished request (all its samples)",
            lengths,
        )
        # Bound once: a gap is observed per sample and step. Kept in a dict, not as attributes,
        # so that only the families are attributes (tests walk them).
        self._bound = {"gap": self.token_gap.labels(self.model_name)}

    def set_backends(self, backends, calibration=None) -> None:
        """The loaded model's KernelBackends and the linear layers' calibration."""
        how = (
            "set"
            if calibration is None or not calibration.seconds
            else "cached"
            if calibration.cached
            else "timed"
        )
        for kind in ("attention", "linear", "fused_ops"):
            self.kernel_backend.labels(
                kind, getattr(backends, kind), how if kind == "linear" else "set"
            ).set(1)

    def by_priority(self, hist: Histogram, priority: int):
        """`hist`'s child for this model and `priority` (one of _hist's histograms)."""
        return hist.labels(self.model_name, priority_label(priority))

    def set_partition(self, topic: str, partition: int, lag: int, backlog: int) -> None:
        """An owned request partition's lag and backlog (group mode)."""
        self.consumer_lag.labels(topic, str(partition)).set(max(0, lag))
        self.partition_backlog.labels(topic, str(partition)).set(backlog)

    def forget_partition(self, topic: str, partition: int) -> None:
        """A partition no longer owned: its gauges go (another worker reports them)."""
        for gauge in (self.consumer_lag, self.partition_backlog):
            with contextlib.suppress(KeyError):
                gauge.remove(topic, str(partition))

    def observe_receipt(self, received: float, sent_at: float | None) -> None:
        """A request admitted at `received`, its record stamped `sent_at` (Unix seconds)."""
        if sent_at is not None:
            # Clamped: a producer's clock ahead of ours (or a timestamp it set in the future)
            # would make a negative time; it counts as no time in Kafka.
            self.time_in_kafka.labels(self.model_name).observe(max(0.0, received - sent_at))

    def observe_first_token(
        self, priority: int, ttft_s: float, e2e_ttft_s: float, num_prompt_tokens: int
    ) -> None:
        """A request's first token: TTFT from receipt and from its record's timestamp."""
        self.by_priority(self.ttft, priority).observe(ttft_s)
        self.e2e_ttft.labels(self.model_name).observe(max(0.0, e2e_ttft_s))
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)

    def observe_gap(self, gap_s: float) -> None:
        """The time since the sample's previous step with tokens."""
        self._bound["gap"].observe(gap_s)

    def observe_lengths(self, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """A finished request's prompt and output lengths."""
        self.request_prompt_tokens.labels(self.model_name).observe(num_prompt_tokens)
        self.request_generation_tokens.labels(self.model_name).observe(num_output_tokens)

    def observe_finish(
        self, reason: str, error_code: str | None, priority: int, e2e_s: float, itl_s: float | None
    ) -> None:
        self.requests.labels(reason).inc()
        if reason == "rejected":
            self.rejections.labels(error_code or "invalid_request").inc()
        self.by_priority(self.e2e, priority).observe(max(0.0, e2e_s))
        if itl_s is not None:
            self.by_priority(self.itl, priority).observe(itl_s)

    def observe_engine(self, st, prev, num_waiting: int) -> None:
        """One engine step's EngineStats; `prev`'s totals make deltas."""
        self.running.set(st.num_running)
        self.waiting.set(num_waiting)
        self.kv_cache_usage.set(st.kv_cache_usage)
        self.kv_cache_waste.set(st.kv_cache_waste)
        self.batch_size.set(st.batch_size)
        self.batched_tokens.set(st.num_batched_tokens)
        if st.num_steps > prev.num_steps and st.batch_size:
            self.iteration.observe(st.step_time_s)
        self.preemptions.inc(max(0, st.num_preemptions - prev.num_preemptions))
        generated = max(0, st.num_generated_tokens - prev.num_generated_tokens)
        self.tokens_generated.labels(self.model_name).inc(generated)
        self.prefix_queries.inc(max(0, st.prefix_cache_queries - prev.prefix_cache_queries))
        self.prefix_hits.inc(max(0, st.prefix_cache_hits - prev.prefix_cache_hits))
        self.spec_drafts.inc(max(0, st.spec_draft_tokens - prev.spec_draft_tokens))
        self.spec_accepted.inc(max(0, st.spec_accepted_tokens - prev.spec_accepted_tokens))
        self.forked_samples.inc(max(0, st.num_forks - prev.num_forks))
        self.observe_tenants(st.tenant_load, st.tenant_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
