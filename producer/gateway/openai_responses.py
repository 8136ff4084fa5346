"""Contract results -> OpenAI response bodies and stream chunks (chat and legacy completions)."""
from __future__ import annotations

import json
import time

from producer.schema import Usage

# OpenAI's finish reasons are `stop` and `length` (errors never reach a body).
FINISH = {"stop": "stop", "length": "length"}


def usage_body(usage: Usage | None) -> dict:
    prompt, completion = (usage.prompt_tokens, usage.completion_tokens) if usage else (0, 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Shape:
    """How one endpoint's responses look: ``chat`` for /v1/chat/completions, else /v1/completions."""

    def __init__(self, chat: bool, request_id: str, model: str):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str, usage: Usage | None) -> dict:
        """The non-streamed answer."""
        finish = FINISH.get(finish_reason, finish_reason)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage_body(usage)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage_body(usage)}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, first: bool = False,
              include_usage: bool = False) -> str:
        """One SSE event with new text (chat: ``first`` also carries the role)."""
        finish = FINISH.get(finish_reason, finish_reason) if finish_reason else None
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            body = {**self._head("text_completion"), "choices": [choice]}
        if include_usage:
            body["usage"] = None  # as OpenAI: null on every chunk but the last
        return sse(body)

    def usage_chunk(self, usage: Usage | None) -> str:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self._head(obj), "choices": [], "usage": usage_body(usage)})


def sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


DONE = sse("[DONE]")
