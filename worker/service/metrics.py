"""The worker's Prometheus metrics, on a registry per Worker (tests run several in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets from 5 ms to 10 min: queue time spans that range under load.
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_STEP = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


def priority_label(priority: int) -> str:
    """Priorities are producer-chosen ints: clamp the label to bound cardinality."""
    if priority < -10:
        return "lt-10"
    if priority > 10:
        return "gt10"
    return str(priority)


class Metrics:
    def __init__(self) -> None:
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
            "inferline_tokens_generated", "Output tokens generated", registry=r
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
            ["partition"],
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
        self.consumer_restarts = Counter(
            "inferline_consumer_restarts",
            "Group consumers replaced after the broker refused them (a static member's "
            "instance id still held by its killed predecessor's session)",
            registry=r,
        )
        self.intake_paused = Gauge(
            "inferline_intake_paused", "1 while intake is paused (backpressure)", registry=r
        )

    def _hist(self, name: str, doc: str) -> Histogram:
        return Histogram(name, doc, ["priority"], buckets=_LATENCY, registry=self.registry)

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

    def observe_finish(
        self, reason: str, error_code: str | None, priority: int, e2e_s: float, itl_s: float | None
    ) -> None:
        label = priority_label(priority)
        self.requests.labels(reason).inc()
        if reason == "rejected":
            self.rejections.labels(error_code or "invalid_request").inc()
        self.e2e.labels(label).observe(max(0.0, e2e_s))
        if itl_s is not None:
            self.itl.labels(label).observe(itl_s)

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
        self.tokens_generated.inc(max(0, st.num_generated_tokens - prev.num_generated_tokens))
        self.prefix_queries.inc(max(0, st.prefix_cache_queries - prev.prefix_cache_queries))
        self.prefix_hits.inc(max(0, st.prefix_cache_hits - prev.prefix_cache_hits))
        self.spec_drafts.inc(max(0, st.spec_draft_tokens - prev.spec_draft_tokens))
        self.spec_accepted.inc(max(0, st.spec_accepted_tokens - prev.spec_accepted_tokens))
        self.forked_samples.inc(max(0, st.num_forks - prev.num_forks))

    def render(self) -> bytes:
        return generate_latest(self.registry)
