"""The loads of bench/gateway.py, each the same requests at the same concurrency: straight onto
Kafka (InferenceClient), through the gateway with the openai SDK, and through the gateway with
guidellm (a subprocess); and the idle TTFT probe. Each load gives one Timed per request, on one
clock per load."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Timed:
    """One request: seconds on the load's own clock (start = sent), and its output tokens."""

    start: float
    first: float | None
    end: float
    tokens: int
    ok: bool


async def concurrently(items, concurrency: int, one) -> list[Timed]:
    """`one(item)` for every item, never more than `concurrency` at a time (guidellm's
    `concurrent` profile: a stream starts its next request when its last one ends)."""
    queue = list(reversed(items))
    out: list[Timed] = []

    async def stream():
        while queue:
            out.append(await one(queue.pop()))

    await asyncio.gather(*(stream() for _ in range(concurrency)))
    return out


# ---- straight onto Kafka, and through the gateway with the openai SDK --------------------------------


class KafkaDriver:
    """Requests straight onto the request topic (the project's InferenceClient)."""

    def __init__(self, settings, topics):
        from inferline.producer.client import InferenceClient

        self.client = InferenceClient(settings=settings, request_topic=topics.requests, cancel_topic=topics.cancel)

    async def __aenter__(self) -> KafkaDriver:
        await self.client.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()

    async def one(self, item) -> Timed:
        start = time.monotonic()
        handle = await self.client.submit(messages=item.messages, max_tokens=item.max_tokens, temperature=0.0,
                                          ignore_eos=True)
        r = await handle.result(check=False)
        first = None if r.client_ttft_s is None else start + r.client_ttft_s
        tokens = r.usage.completion_tokens if r.usage else len(r.token_ids)
        return Timed(start, first, time.monotonic(), tokens, handle.failure is None)


class SdkDriver:
    """The same requests through the gateway: the openai SDK, streamed, usage in the last chunk."""

    def __init__(self, base_url: str):
        import openai

        self.openai = openai
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)

    async def __aenter__(self) -> SdkDriver:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()

    async def one(self, item) -> Timed:
        start, first, tokens = time.monotonic(), None, 0
        try:
            stream = await self.client.chat.completions.create(
                model=MODEL, messages=item.messages, max_tokens=item.max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.monotonic()
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
        except self.openai.APIError:
            return Timed(start, first, time.monotonic(), tokens, False)
        return Timed(start, first, time.monotonic(), tokens, True)


async def drive(driver, items, concurrency: int, warm: int = 2, on_start=None) -> list[Timed]:
    """A warm-up (connections, topic metadata), ``on_start()``, then the load."""
    async with driver:
        await concurrently([shorter(i) for i in items[:warm]], warm, driver.one)
        if on_start is not None:
            on_start()
        return await concurrently(items, concurrency, driver.one)


async def idle_probe(drivers: dict, items, n: int) -> dict[str, list[float]]:
    """TTFT of single 2-token requests, one at a time, the drivers taking turns (ABBA): pairs
    measured moments apart, so a busy machine's drift cancels out."""
    names = list(drivers)
    ttft: dict[str, list[float]] = {name: [] for name in names}
    async with contextlib.AsyncExitStack() as stack:
        for d in drivers.values():
            await stack.enter_async_context(d)
        for i in range(n):
            for name in names if i % 2 == 0 else reversed(names):
                t = await drivers[name].one(shorter(items[i % len(items)]))
                if t.ok and t.first is not None:
                    ttft[name].append(t.first - t.start)
    return ttft


def shorter(item):
    """A warm-up or probe copy of a request: 2 tokens."""
    from dataclasses import replace

    return replace(item, max_tokens=2)


# ---- through the gateway: guidellm ----------------------------------------------------------------


def guidellm_scenario(target: str, data: Path, tokenizer: Path, out: Path, n: int, concurrency: int) -> dict:
    """A guidellm 0.8 scenario: our prompts and output lengths (json_file: `prompt`,
    `output_tokens_count`), `concurrency` streams, `n` requests, the model's own tokenizer."""
    return {"spec": {
        "backend": {"kind": "openai_http", "target": target, "model": MODEL, "request_format": "/v1/chat/completions"},
        "profile": {"kind": "concurrent", "streams": [concurrency]},
        "data": [{"kind": "json_file", "path": str(data)}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
        "constraints": [{"kind": "max_requests", "count": n}],
        "outputs": [{"kind": "json", "path": str(out)}],
    }}


def guidellm_env(workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    # Offline: the tokenizer is a local folder, the data a local file; nothing may reach a hub.
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                # One worker process, not ten: this machine has two cores, shared with the fleet.
                "GUIDELLM__MAX_WORKER_PROCESSES": "1",
                "GUIDELLM__LOGGING__LOG_FILE": str(workdir / "guidellm.log")})
    return env


def run_guidellm(guidellm: str, target: str, items, tokenizer: Path, workdir: Path, concurrency: int,
                 timeout_s: float) -> tuple[list[Timed], dict]:
    """guidellm over the gateway; its per-request timings and the CPU seconds it used."""
    workdir.mkdir(parents=True, exist_ok=True)
    data, out, scenario = workdir / "prompts.jsonl", workdir / "guidellm.json", workdir / "scenario.json"
    data.write_text("".join(json.dumps({"prompt": i.messages[0]["content"], "output_tokens_count": i.max_tokens}) + "\n"
                            for i in items))
    scenario.write_text(json.dumps(guidellm_scenario(target, data, tokenizer, out, len(items), concurrency)))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([guidellm, "run", "-c", str(scenario), "--disable-progress"], cwd=workdir,
                          env=guidellm_env(workdir), capture_output=True, text=True, timeout=timeout_s)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    (workdir / "guidellm.out").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"guidellm exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return guidellm_requests(json.loads(out.read_text())), {"guidellm_cpu_s": cpu}


def guidellm_requests(report: dict) -> list[Timed]:
    """Per request, from guidellm's JSON report (its one benchmark's successful and errored requests)."""
    (bench,) = report["benchmarks"]
    requests = bench["requests"]
    out = [_timed(r, True) for r in requests.get("successful", [])]
    return out + [_timed(r, False) for r in requests.get("errored", []) + requests.get("incomplete", [])]


def _timed(r: dict, ok: bool) -> Timed:
    t = r["info"]["timings"]
    start = t.get("request_start") or t["resolve_start"]
    end = t.get("request_end") or t.get("resolve_end") or start
    tokens = r.get("output_tokens") or 0
    return Timed(start, t.get("first_token_iteration"), end, tokens, ok)
