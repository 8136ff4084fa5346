"""The Responses API's stream events (response.created ... response.completed, each with its
`sequence_number`) out of the chat path's SSE stream. design: docs/gateway.md#responses-api
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from inferline.producer.gateway.responses_mapping import (
    call_item,
    finish,
    message_item,
    reasoning_item,
)


class EventStream:
    """Chat chunks -> Responses stream events, each with its `sequence_number`; the output items
    are built as they come, for the final `response.completed`."""

    def __init__(self, response: dict):
        self.response, self.output = response, []
        self.seq = 0
        self.open: dict | None = None  # the output item being written
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        return [
            self.event("response.created", response=self.response),
            self.event("response.in_progress", response=self.response),
        ]

    def chunk(self, chunk: dict) -> list[str]:
        """The events of one chat chunk."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return out

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def _open(self, item: dict) -> list[str]:
        out = self.close()
        self.open = item
        self.output.append(item)
        return out + [
            self.event(
                "response.output_item.added",
                output_index=len(self.output) - 1,
                item={**item, "content": []} if "content" in item else item,
            )
        ]

    def _text(self, kind: str, text: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != kind:
            item = (
                reasoning_item("", "in_progress")
                if kind == "reasoning"
                else message_item("", "in_progress")
            )
            out += self._open(item)
            out.append(
                self.event(
                    "response.content_part.added",
                    **self._where(),
                    content_index=0,
                    part=item["content"][0],
                )
            )
        self.open["content"][0]["text"] += text
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + [self.event(name, **self._where(), content_index=0, delta=text, **extra)]

    def _call(self, call: dict) -> list[str]:
        out: list[str] = []
        f = call.get("function") or {}
        if call.get("id"):
            out += self._open(call_item(call["id"], f.get("name", ""), "", "in_progress"))
        pieces = f.get("arguments") or ""
        if pieces and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += pieces
            out.append(
                self.event("response.function_call_arguments.delta", **self._where(), delta=pieces)
            )
        return out

    def close(self) -> list[str]:
        """The `.done` events of the item being written."""
        item, out = self.open, []
        if item is None:
            return out
        where = self._where()
        if item["type"] == "function_call":
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:
            part = item["content"][0]
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            out.append(
                self.event(
                    f"response.{kind}.done", **where, content_index=0, text=part["text"], **extra
                )
            )
            out.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
        item["status"] = "completed"
        out.append(
            self.event("response.output_item.done", output_index=where["output_index"], item=item)
        )
        self.open = None
        return out

    def completed(self) -> list[str]:
        """Open items closed; the response is then whole (`last` sends it)."""
        out = self.close()
        finish(self.response, self.output, self.finish_reason, self.usage)
        return out

    def error(self, error: dict) -> list[str]:
        """A failure after the stream began: OpenAI's `error` event (`last`: response.failed)."""
        code = error.get("code") or "server_error"
        self.response.update(status="failed", error={"code": code, "message": error["message"]})
        return [self.event("error", **{k: error.get(k) for k in ("code", "message", "param")})]

    def last(self) -> str:
        """The response as it ended: response.completed, .incomplete or .failed."""
        return self.event(f"response.{self.response['status']}", response=self.response)


async def translate(
    chunks: AsyncIterator[str],
    events: EventStream,
    on_end: Callable[[dict], Awaitable[None]],
) -> AsyncIterator[str]:
    """A chat SSE stream -> the Responses stream; `on_end(response)` (which stores it) runs
    before the last event, so a client that has it can read the response back."""
    for e in events.start():
        yield e
    tail: list[str] = []
    async for raw in chunks:
        for body in _bodies(raw):
            if "error" in body:  # the chat stream's last event
                tail = events.error(body["error"])
                break
            for e in events.chunk(body):
                yield e
    if events.response["status"] != "failed":
        tail = events.completed()
    await on_end(events.response)
    for e in [*tail, events.last()]:
        yield e


def _bodies(raw: str) -> list[dict]:
    """The JSON bodies of a piece of a chat SSE stream ([DONE] left out)."""
    datas = [line.removeprefix("data: ") for line in raw.split("\n") if line.startswith("data: ")]
    return [json.loads(d) for d in datas if d != "[DONE]"]
