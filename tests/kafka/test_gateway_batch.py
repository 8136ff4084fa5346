"""The gateway's Batch API, driven by the official `openai` SDK against the real broker and a
real worker: files, a batch to completion, a cancel, tenants, and a batch whose gateway stops
mid-run, resumed by another instance that sees the same state (compacted topics)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import openai
import pytest

from tests.gateway_fixtures import fleet, start_gateway, stop_gateway  # noqa: F401 - fixtures
from tests.kafka.test_batch import chat_line, check_format

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

TERMINAL = ("completed", "failed", "cancelled", "expired")


def client(url: str, key: str = "sk-acme") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)


async def wait_status(
    api: openai.AsyncOpenAI, batch_id: str, statuses=TERMINAL, timeout: float = 300
):
    deadline = time.monotonic() + timeout
    while True:
        batch = await api.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        await asyncio.sleep(0.3)


async def lines_of(api: openai.AsyncOpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in (await api.files.content(file_id)).text.splitlines()]


async def upload(api: openai.AsyncOpenAI, lines: list[str]):
    return await api.files.create(
        file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch"
    )


async def test_batch_to_completion_with_the_sdk(fleet):
    api = client(fleet.url)
    lines = [chat_line(f"q{i}", f"Say {i}.") for i in range(5)] + [
        chat_line("bad", "x", temperature=-1)
    ]
    f = await upload(api, lines)
    assert (f.purpose, f.bytes, f.filename) == (
        "batch",
        len(("\n".join(lines) + "\n").encode()),
        "in.jsonl",
    )
    assert (await api.files.retrieve(f.id)).id == f.id
    assert (await api.files.content(f.id)).text == "\n".join(lines) + "\n"

    batch = await api.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "eval"},
    )
    assert batch.status == "validating" and batch.metadata == {"job": "eval"}
    done = await wait_status(api, batch.id)
    assert done.status == "completed", done
    assert (
        done.request_counts.total,
        done.request_counts.completed,
        done.request_counts.failed,
    ) == (6, 5, 1)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.expires_at
    outs, errs = await lines_of(api, done.output_file_id), await lines_of(api, done.error_file_id)
    assert sorted(o["custom_id"] for o in outs) == [f"q{i}" for i in range(5)]
    assert [e["custom_id"] for e in errs] == ["bad"] and errs[0]["error"]["message"].startswith(
        "line 6: body.temperature"
    )
    for out in outs + errs:
        check_format(out)
    assert (await api.files.retrieve(done.output_file_id)).purpose == "batch_output"

    listed = [b.id async for b in api.batches.list()]
    assert batch.id in listed
    # Another tenant's key sees neither the batch nor the files.
    other = client(fleet.url, "sk-slow")
    with pytest.raises(openai.NotFoundError):
        await other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        await other.files.content(done.output_file_id)
    assert batch.id not in [b.id async for b in other.batches.list()]
    with pytest.raises(openai.BadRequestError):
        await api.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError):
        await api.batches.create(
            input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h"
        )
    dup = await upload(api, [chat_line("a", "x"), chat_line("a", "y")])
    failed = await wait_status(
        api,
        (
            await api.batches.create(
                input_file_id=dup.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        ).id,
    )
    assert failed.status == "failed" and failed.errors.data[0].code == "duplicate_custom_id"


async def test_cancel(fleet):
    api = client(fleet.url)
    f = await upload(api, [chat_line(f"c{i}", f"Count to {i}.", max_tokens=32) for i in range(60)])
    batch = await api.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    await wait_status(api, batch.id, ("in_progress",))
    cancelling = await api.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = await wait_status(api, batch.id)
    assert done.status == "cancelled" and done.cancelled_at, done
    outs, errs = await lines_of(api, done.output_file_id), await lines_of(api, done.error_file_id)
    assert len(outs) + len(errs) == 60 and len({o["custom_id"] for o in outs + errs}) == 60
    assert any(e["error"] and e["error"]["code"] == "batch_cancelled" for e in errs)
    with pytest.raises(openai.ConflictError):
        await api.batches.cancel(batch.id)


async def test_a_stopped_gateways_batch_is_resumed_by_another(fleet):
    """Gateway B takes a batch and stops mid-run; A (the fleet's) sees the same files and batches
    and, once B's lease has lapsed, resumes it: every line answered exactly once."""
    server, task, url_b = await start_gateway(fleet.settings)
    api_b, api_a = client(url_b), client(fleet.url)
    n = 40
    f = await upload(
        api_b, [chat_line(f"r{i}", f"Name {i} colours.", max_tokens=12) for i in range(n)]
    )
    assert (await api_a.files.retrieve(f.id)).bytes == f.bytes  # the other replica sees it
    batch = await api_b.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 120
    while True:  # A sees B's batch (a moment later: it follows the state topic) and its progress
        assert time.monotonic() < deadline
        with contextlib.suppress(openai.NotFoundError):
            if (await api_a.batches.retrieve(batch.id)).request_counts.completed >= 5:
                break
        await asyncio.sleep(0.3)
    await stop_gateway(server, task)
    mid = await api_a.batches.retrieve(batch.id)
    assert mid.status == "in_progress" and mid.request_counts.completed < n
    done = await wait_status(api_a, batch.id, timeout=300)
    assert done.status == "completed" and done.request_counts.completed == n, done
    outs = await lines_of(api_a, done.output_file_id)
    assert sorted(o["custom_id"] for o in outs) == sorted(f"r{i}" for i in range(n))
    for out in outs:
        check_format(out)


async def test_a_deleted_file_is_gone_from_every_replica_but_a_running_batchs_input_stays(fleet):
    """DELETE /v1/files/{id}: the file is gone here and, once it follows the topic, from another
    replica; another tenant cannot delete it; the input of an unfinished batch is refused (409:
    a gateway resuming the batch reads it again) until the batch ends."""
    server, task, url_b = await start_gateway(fleet.settings)
    api, api_b = client(fleet.url), client(url_b)
    try:
        spare = await upload(api, [chat_line("d0", "Hi.", max_tokens=4)])
        busy = await upload(
            api, [chat_line(f"b{i}", f"Count to {i}.", max_tokens=32) for i in range(40)]
        )
        with pytest.raises(openai.NotFoundError):
            await client(fleet.url, key="sk-slow").files.delete(spare.id)
        deleted = await api.files.delete(spare.id)
        assert deleted.id == spare.id and deleted.deleted is True
        with pytest.raises(openai.NotFoundError):
            await api.files.retrieve(spare.id)
        deadline = time.monotonic() + 60
        while True:  # replica B follows the tombstone
            try:
                await api_b.files.retrieve(spare.id)
            except openai.NotFoundError:
                break
            assert time.monotonic() < deadline, "replica B still serves a deleted file"
            await asyncio.sleep(0.3)

        batch = await api.batches.create(
            input_file_id=busy.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        await wait_status(api, batch.id, ("in_progress",))
        with pytest.raises(openai.ConflictError):
            await api.files.delete(busy.id)
        await api.batches.cancel(batch.id)
        await wait_status(api, batch.id)
        assert (await api.files.delete(busy.id)).deleted is True
    finally:
        await stop_gateway(server, task)
