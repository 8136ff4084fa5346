"""OpenAI's Batch API in the gateway (`/v1/batches`): each batch's state in a compacted topic, run
by one instance at a time under a lease. design: docs/batch.md#the-batch-api-in-the-gateway
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any

import structlog
from aiokafka.admin import AIOKafkaAdminClient

from inferline.config.settings import Settings
from inferline.producer.batch.lines import (
    BATCH_PRIORITY,
    URLS,
    DuplicateCustomIds,
    error_line,
    failed,
    parse_lines,
)
from inferline.producer.batch.runner import BatchRunner
from inferline.producer.client import InferenceClient
from inferline.producer.gateway.errors import OpenAIError, bad_request
from inferline.producer.gateway.files import FileStore
from inferline.producer.gateway.table import TopicTable

log = structlog.get_logger(__name__)

TERMINAL = ("completed", "failed", "cancelled", "expired")
HEARTBEAT_S = 2.0
LEASE_S = 10.0
CLAIM_SETTLE_S = 1.0  # long enough to read a rival's claim back
WINDOWS = {"24h": 86_400}  # OpenAI's only completion window
MAX_IN_FLIGHT = 64  # per batch
INTERNAL = ("tenant", "owner", "heartbeat")


def state_topics(settings: Settings) -> tuple[str, str]:
    """(files topic, batches topic): two segments deep, so topic tenancy never reads them as a
    tenant's request topic."""
    base = settings.kafka.request_topic
    return f"{base}.batch.files", f"{base}.batch.state"


def batches_need_topic_rights(prefix: str) -> OpenAIError:
    """Each batch reads its replies from a topic of its own, made and deleted by the gateway: a
    gateway without topic rights refuses batches at once rather than failing each at its start."""
    return OpenAIError(
        501,
        "batches: this gateway runs without topic rights (INFERLINE_KAFKA__CREATE_REPLY_TOPICS="
        f"false), and each batch needs a reply topic of its own ({prefix}batch-<id>: CREATE and "
        "DELETE on that prefix)",
        type="server_error",
        code="batches_unavailable",
    )


class BatchService:
    def __init__(self, settings: Settings, instance: str):
        self.settings, self.instance = settings, instance
        self.model = settings.gateway.model_name
        files_topic, state_topic = state_topics(settings)
        self.files = FileStore(TopicTable(settings.kafka, files_topic))
        self.table = TopicTable(settings.kafka, state_topic, on_change=self._changed)
        self.running: dict[str, asyncio.Task] = {}
        self.live: dict[str, dict] = {}  # records of the batches this instance runs
        self._cancels: dict[str, asyncio.Event] = {}
        self._leases: asyncio.Task | None = None
        self.available = False

    async def start(self) -> None:
        """Read the files and batches; if ACLs refuse their topics, only the Batch API stays off."""
        try:
            await self.files.table.start()
            await self.table.start()
        except Exception as exc:
            log.warning(
                "batch api unavailable",
                error=repr(exc),
                topics=[self.files.table.topic, self.table.topic],
            )
            await self.table.close()
            await self.files.table.close()
            return
        self.available = True
        self._leases = asyncio.create_task(self._lease_loop(), name="batch-leases")

    async def close(self) -> None:
        """Stop running batches without ending them: another instance resumes them."""
        tasks = [t for t in (self._leases, *self.running.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.table.close()
        await self.files.table.close()

    # --- the HTTP side ------------------------------------------------------------------------

    async def record(self, batch_id: str, tenant: str | None) -> dict:
        raw = await self.table.get(batch_id)
        rec = json.loads(raw) if raw is not None else None
        if rec is None or rec.get("tenant") != tenant:
            raise OpenAIError(404, f"no such batch: {batch_id}", param="batch_id", code="not_found")
        return self.live.get(batch_id, rec)

    def public(self, rec: dict) -> dict:
        return {k: v for k, v in rec.items() if k not in INTERNAL}

    async def create(self, tenant: str | None, body: dict) -> dict:
        """POST /v1/batches."""
        if not self.settings.kafka.create_reply_topics:
            raise batches_need_topic_rights(self.settings.kafka.reply_topic_prefix)
        file_id, endpoint, window = (
            body.get("input_file_id"),
            body.get("endpoint"),
            body.get("completion_window"),
        )
        if not isinstance(file_id, str):
            raise bad_request("input_file_id", "input_file_id: required")
        try:
            meta = await self.files.meta(file_id, tenant)
        except OpenAIError:
            raise bad_request("input_file_id", f"input_file_id: no such file: {file_id}") from None
        if meta["purpose"] != "batch":
            raise bad_request("input_file_id", "input_file_id: the file's purpose must be batch")
        if endpoint not in URLS:
            raise bad_request("endpoint", f"endpoint: must be one of {', '.join(URLS)}")
        if window not in WINDOWS:
            raise bad_request(
                "completion_window", f"completion_window: must be one of {', '.join(WINDOWS)}"
            )
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16):
            raise bad_request("metadata", "metadata: at most 16 string pairs")
        now = int(time.time())
        rec = {
            "id": f"batch_{uuid.uuid4().hex}",
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": file_id,
            "completion_window": window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + WINDOWS[window],
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
            "tenant": tenant,
        }
        await self._save(rec)
        self._launch(rec)
        return self.public(rec)

    async def cancel(self, tenant: str | None, batch_id: str) -> dict:
        """POST /v1/batches/{id}/cancel: the owner (this instance or another) stops it."""
        rec = await self.record(batch_id, tenant)
        if rec["status"] in TERMINAL:
            raise OpenAIError(
                409, f"cannot cancel a batch with status {rec['status']}", code="conflict"
            )
        if rec["status"] != "cancelling":
            # In place when this instance runs it: every save writes the dict its run updates.
            rec.update(status="cancelling", cancelling_at=int(time.time()))
            await self._save(rec, heartbeat=batch_id in self.running)
            self._changed(batch_id, json.dumps(rec).encode())
        return self.public(rec)

    async def delete_file(self, tenant: str | None, file_id: str) -> dict:
        """Delete a file, unless it is an unfinished batch's input: 409 until that batch ends."""
        await self.files.meta(file_id, tenant)
        recs = [json.loads(raw) for raw in list(self.table.data.values())]
        for rec in (self.live.get(r["id"], r) for r in recs):
            if rec.get("input_file_id") == file_id and rec["status"] not in TERMINAL:
                raise OpenAIError(
                    409,
                    f"file {file_id} is the input of batch {rec['id']}, which is "
                    f"{rec['status']}: cancel it or wait for it to end",
                    param="file_id",
                    code="file_in_use",
                )
        return await self.files.delete(file_id, tenant)

    def list(self, tenant: str | None, limit: int = 20, after: str | None = None) -> dict:
        recs = [json.loads(v) for v in self.table.data.values()]
        mine = sorted(
            (self.live.get(r["id"], r) for r in recs if r.get("tenant") == tenant),
            key=lambda r: (r["created_at"], r["id"]),
            reverse=True,
        )
        if after is not None:
            ids = [r["id"] for r in mine]
            mine = mine[ids.index(after) + 1 :] if after in ids else []
        page = [self.public(r) for r in mine[:limit]]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(mine) > limit,
        }

    # --- state ------------------------------------------------------------------------------

    async def _save(self, rec: dict, heartbeat: bool = True) -> None:
        stored = {
            **rec,
            "owner": self.instance if heartbeat else rec.get("owner"),
            "heartbeat": time.time() if heartbeat else rec.get("heartbeat", 0),
        }
        await self.table.put(rec["id"], json.dumps(stored).encode())

    async def _update(self, rec: dict, **changes: Any) -> None:
        rec.update(changes)
        await self._save(rec)

    def _changed(self, key: str, value: bytes) -> None:
        rec = json.loads(value)
        if key in self._cancels and rec.get("status") == "cancelling":
            self._cancels[key].set()
            if key in self.live:
                self.live[key].update(status="cancelling", cancelling_at=rec.get("cancelling_at"))

    async def _lease_loop(self) -> None:
        while True:
            try:
                await self._heartbeats()
                await self._adopt()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("batch lease loop", error=repr(exc))
            await asyncio.sleep(HEARTBEAT_S)

    async def _heartbeats(self) -> None:
        for batch_id, rec in list(self.live.items()):
            stored = json.loads(self.table.data.get(batch_id, b"{}"))
            if stored.get("owner") not in (None, self.instance):  # taken over by another instance
                log.warning("batch taken over", batch_id=batch_id, owner=stored.get("owner"))
                self.running[batch_id].cancel()
                continue
            await self._save(rec)

    async def _adopt(self) -> None:
        now = time.time()
        stale = [json.loads(v) for v in self.table.data.values()]
        stale = [
            r
            for r in stale
            if r.get("status") not in TERMINAL
            and r["id"] not in self.running
            and now - r.get("heartbeat", 0) > LEASE_S
        ]
        for rec in stale:
            await self._save(rec)
        if not stale:
            return
        await asyncio.sleep(CLAIM_SETTLE_S)
        for rec in stale:
            latest = json.loads(self.table.data[rec["id"]])
            if latest.get("owner") == self.instance and rec["id"] not in self.running:
                log.info("batch resumed", batch_id=rec["id"], status=latest["status"])
                self._launch({k: v for k, v in latest.items() if k not in ("owner", "heartbeat")})

    # --- running one batch --------------------------------------------------------------------

    def _launch(self, rec: dict) -> None:
        batch_id = rec["id"]
        self.live[batch_id] = rec
        self._cancels[batch_id] = event = asyncio.Event()
        if rec["status"] == "cancelling":
            event.set()
        task = asyncio.create_task(self._run(rec), name=f"batch-{batch_id}")
        self.running[batch_id] = task

        def forget(_task: asyncio.Task) -> None:
            self.running.pop(batch_id, None)
            self.live.pop(batch_id, None)
            self._cancels.pop(batch_id, None)

        task.add_done_callback(forget)

    async def _run(self, rec: dict) -> None:
        try:
            await self._execute(rec)
        except asyncio.CancelledError:
            raise  # shutdown or taken over: it goes on elsewhere
        except Exception as exc:
            log.exception("batch failed", batch_id=rec["id"])
            await self._fail(rec, "internal", f"the gateway could not run the batch: {exc!r}"[:500])

    async def _fail(self, rec: dict, code: str, message: str) -> None:
        errors = {
            "object": "list",
            "data": [{"code": code, "message": message, "param": None, "line": None}],
        }
        await self._update(rec, status="failed", failed_at=int(time.time()), errors=errors)

    async def _execute(self, rec: dict) -> None:
        batch_id, tenant = rec["id"], rec["tenant"]
        try:
            lines = parse_lines(
                (await self.files.content(rec["input_file_id"], tenant)).decode("utf-8"),
                priority=BATCH_PRIORITY,
            )
        except (UnicodeDecodeError, DuplicateCustomIds, OpenAIError) as exc:
            code = "duplicate_custom_id" if isinstance(exc, DuplicateCustomIds) else "invalid_file"
            return await self._fail(rec, code, str(exc))
        if not lines:
            return await self._fail(rec, "empty_file", "the input file has no lines")
        for line in lines:
            if line.error is None and line.url != rec["endpoint"]:
                line.error = (
                    f"line {line.lineno}: url: must be the batch's endpoint {rec['endpoint']}"
                )
        counts = {"total": len(lines), "completed": 0, "failed": 0}
        if rec["status"] == "validating":
            await self._update(
                rec, status="in_progress", in_progress_at=int(time.time()), request_counts=counts
            )
        rec["request_counts"] = counts
        results: list[dict] = []

        def sink(_line, out: dict, _tokens: int) -> None:
            results.append(out)
            counts["failed" if failed(out) else "completed"] += 1

        client = self._client(batch_id, tenant)
        async with client:
            runner = BatchRunner(
                client,
                batch_id,
                lines,
                sink,
                max_in_flight=MAX_IN_FLIGHT,
                model=self.model,
                timeout_s=self.settings.gateway.request_timeout_s,
                retry_after_s=self.settings.gateway.retry_after_s,
                extra_fields={"tenant": tenant} if tenant else None,
                collect_only=self._cancels[batch_id].is_set(),
            )
            outcome = await self._until_done(runner, rec)
            if outcome != "completed":  # what still runs is not wanted any more
                await asyncio.gather(
                    *(client.cancel(rid) for rid in runner.unanswered()), return_exceptions=True
                )
        await self._finalize(rec, lines, results, runner.written, outcome)
        await self._drop_topic(client.reply_topic)

    async def _until_done(self, runner: BatchRunner, rec: dict) -> str:
        run = asyncio.create_task(runner.run())
        stop = asyncio.create_task(self._cancels[rec["id"]].wait())
        try:
            left = max(0.0, rec["expires_at"] - time.time())
            await asyncio.wait({run, stop}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if run.done() and not self._cancels[rec["id"]].is_set():
                run.result()
                return "completed"
            return "cancelled" if self._cancels[rec["id"]].is_set() else "expired"
        finally:
            for task in (run, stop):
                task.cancel()
            await asyncio.gather(run, stop, return_exceptions=True)

    async def _finalize(
        self, rec: dict, lines, results: list[dict], written: set[str], outcome: str
    ) -> None:
        await self._update(rec, status="finalizing", finalizing_at=int(time.time()))
        code = {"cancelled": "batch_cancelled", "expired": "batch_expired"}.get(outcome)
        missing = (
            [
                error_line(
                    ln,
                    code,
                    f"line {ln.lineno}: the batch was {outcome} before this line was answered",
                )
                for ln in lines
                if ln.key not in written
            ]
            if code
            else []
        )
        ok = [o for o in results if not failed(o)]
        bad = [o for o in results if failed(o)] + missing
        tenant, batch_id = rec["tenant"], rec["id"]
        output = await self._file(ok, f"{batch_id}_output.jsonl", tenant)
        errors = await self._file(bad, f"{batch_id}_error.jsonl", tenant)
        counts = {"total": len(lines), "completed": len(ok), "failed": len(bad)}
        await self._update(
            rec,
            status=outcome,
            **{f"{outcome}_at": int(time.time())},
            output_file_id=output,
            error_file_id=errors,
            request_counts=counts,
        )

    async def _file(self, outs: list[dict], name: str, tenant: str | None) -> str | None:
        if not outs:
            return None
        data = "".join(json.dumps(o, ensure_ascii=False) + "\n" for o in outs).encode()
        return (await self.files.put(data, name, "batch_output", tenant))["id"]

    def _client(self, batch_id: str, tenant: str | None) -> InferenceClient:
        kafka = self.settings.kafka
        request_topic, cancel_topic, prefix = (
            kafka.request_topic,
            kafka.cancel_topic,
            kafka.reply_topic_prefix,
        )
        if kafka.tenancy == "topic":
            request_topic, cancel_topic, prefix = (
                f"{request_topic}.{tenant}",
                f"{cancel_topic}.{tenant}",
                f"{prefix}{tenant}.",
            )
        return InferenceClient(
            request_topic=request_topic,
            cancel_topic=cancel_topic,
            settings=self.settings,
            reply_topic=f"{prefix}batch-{batch_id}",
            reply_partitions=self.settings.gateway.reply_partitions,
            reply_retention_ms=WINDOWS["24h"] * 1000 * 2,
        )

    async def _drop_topic(self, topic: str) -> None:
        admin = AIOKafkaAdminClient(**self.settings.kafka.connection_options())
        with contextlib.suppress(Exception):
            await admin.start()
            await admin.delete_topics([topic])
        with contextlib.suppress(Exception):
            await admin.close()
