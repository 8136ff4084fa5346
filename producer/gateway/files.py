"""The Batch API's files (`/v1/files`) in a compacted topic: chunks (`<id>/<n>`), then the
metadata (`<id>`) that makes a file whole. A file belongs to the uploading key's tenant."""

from __future__ import annotations

import json
import time
import uuid
from email import policy
from email.parser import BytesParser

from inferline.producer.gateway.errors import OpenAIError, bad_request
from inferline.producer.gateway.table import TopicTable

CHUNK_BYTES = 512 * 1024
MAX_FILE_BYTES = 100 * 1024 * 1024  # OpenAI allows 200 MB; these live in memory
PURPOSES = ("batch", "batch_output")


class FileStore:
    def __init__(self, table: TopicTable):
        self.table = table

    async def meta(self, file_id: str, tenant: str | None) -> dict:
        """The file object; 404 unless it is there and the tenant's."""
        record = await self._record(file_id, tenant)
        return {k: v for k, v in record.items() if k not in ("tenant", "chunks")}

    async def content(self, file_id: str, tenant: str | None) -> bytes:
        record = await self._record(file_id, tenant)
        return b"".join(self.table.data[f"{file_id}/{n}"] for n in range(record["chunks"]))

    async def _record(self, file_id: str, tenant: str | None) -> dict:
        raw = await self.table.get(file_id)
        record = json.loads(raw) if raw is not None else None
        if record is None or record.get("tenant") != tenant:
            raise OpenAIError(404, f"no such file: {file_id}", param="file_id", code="not_found")
        return record

    async def delete(self, file_id: str, tenant: str | None) -> dict:
        """OpenAI's deletion object. The metadata goes first: without it the file is gone even if
        its chunks' tombstones are never written."""
        record = await self._record(file_id, tenant)  # 404 unless it is there and the tenant's
        await self.table.delete(file_id)
        for n in range(record["chunks"]):
            await self.table.delete(f"{file_id}/{n}")
        return {"id": file_id, "object": "file", "deleted": True}

    async def put(self, data: bytes, filename: str, purpose: str, tenant: str | None) -> dict:
        if len(data) > MAX_FILE_BYTES:
            raise bad_request("file", f"file: {len(data)} bytes, at most {MAX_FILE_BYTES}")
        file_id = f"file-{uuid.uuid4().hex}"
        chunks = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
        for n, chunk in enumerate(chunks):
            await self.table.put(f"{file_id}/{n}", chunk)
        record = {
            "id": file_id,
            "object": "file",
            "bytes": len(data),
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
            "tenant": tenant,
            "chunks": len(chunks),
        }
        await self.table.put(file_id, json.dumps(record).encode())  # last: the file is whole now
        return await self.meta(file_id, tenant)


def parse_upload(content_type: str, body: bytes) -> tuple[bytes, str, str]:
    """(data, filename, purpose) of a multipart/form-data upload."""
    if not content_type.startswith("multipart/form-data"):
        raise bad_request(None, "the upload must be multipart/form-data with `file` and `purpose`")
    message = BytesParser(policy=policy.HTTP).parsebytes(
        f"Content-Type: {content_type}\r\n\r\n".encode() + body
    )
    fields: dict[str, tuple[bytes, str | None]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name:
            fields[name] = (part.get_payload(decode=True) or b"", part.get_filename())
    if "file" not in fields:
        raise bad_request("file", "file: required")
    purpose = fields.get("purpose", (b"", None))[0].decode(errors="replace")
    if purpose != "batch":
        raise bad_request("purpose", "purpose: must be batch (the only use of files here)")
    data, filename = fields["file"]
    return data, filename or "upload.jsonl", purpose
