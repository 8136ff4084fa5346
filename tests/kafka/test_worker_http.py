"""/healthz, /readyz and /metrics of a running worker."""

import aiohttp
import pytest

from tests.worker_fixtures import REPO, collect, request, start_worker, submit, topics  # noqa: F401


@pytest.mark.kafka
async def test_health_ready_and_metrics(kafka_bootstrap, topics, start_worker):
    worker = await start_worker(topics)
    base = f"http://127.0.0.1:{worker.http.port}"
    ids = await submit(
        kafka_bootstrap, topics.requests, [request(topics.replies, priority=p) for p in (0, 3)]
    )
    await collect(kafka_bootstrap, topics.replies, ids)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/healthz") as resp:
            assert resp.status == 200 and (await resp.json())["status"] == "ok"
        async with http.get(f"{base}/readyz") as resp:
            body = await resp.json()
            assert resp.status == 200 and body["ready"] and body["in_group"], body
        async with http.get(f"{base}/metrics") as resp:
            text = await resp.text()
            assert resp.status == 200 and resp.content_type == "text/plain"
    for name in (
        "inferline_requests_total",
        "inferline_queue_time_seconds_bucket",
        "inferline_ttft_seconds_bucket",
        "inferline_inter_token_latency_seconds_bucket",
        "inferline_e2e_seconds_bucket",
        "inferline_running_requests",
        "inferline_waiting_requests",
        "inferline_kv_cache_usage",
        "inferline_batch_size",
        "inferline_iteration_seconds_bucket",
        "inferline_preemptions_total",
        "inferline_tokens_generated_total",
        "inferline_dead_letters_total",
        "inferline_consumer_lag",
        "inferline_prompt_tokens_total",
        "inferline_inter_token_gap_seconds_bucket",
        "inferline_request_prompt_tokens_bucket",
        "inferline_request_generation_tokens_bucket",
    ):
        assert name in text, name
    model = f'model_name="{worker.settings.gateway.model_name}"'
    assert f'inferline_e2e_seconds_count{{{model},priority="3"}} 1.0' in text
    # The records' Kafka timestamps came through the consumer: both were timed in Kafka.
    assert f"inferline_time_in_kafka_seconds_count{{{model}}} 2.0" in text
    assert f"inferline_e2e_ttft_seconds_count{{{model}}} 2.0" in text
    assert 'inferline_requests_total{outcome="length"} 2.0' in text

    threshold = worker.settings.http.stall_threshold_s
    worker.settings.http.stall_threshold_s = 1e-9  # every tick is now too old: as if wedged
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/healthz") as resp:
            assert resp.status == 503 and (await resp.json())["status"] == "stalled"
    worker.settings.http.stall_threshold_s = threshold
    worker.requests.draining = True
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/readyz") as resp:
            assert resp.status == 503
    worker.requests.draining = False
