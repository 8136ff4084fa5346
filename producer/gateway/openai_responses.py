"""Contract results -> OpenAI response bodies and stream chunks (chat and legacy completions)."""

from __future__ import annotations

import json
import time

from inferline.contract.schema import Sample, TokenLogprob, Usage
from inferline.producer.gateway.reasoning import ReasoningParserName, split
from inferline.producer.gateway.tool_calls import ToolMode, parse

# OpenAI's finish reasons are `stop` and `length` (errors never reach a body), and `tool_calls`
# for a chat answer that made calls (tool_finish).
FINISH = {"stop": "stop", "length": "length"}


def usage_body(usage: Usage | None) -> dict:
    prompt, completion = (usage.prompt_tokens, usage.completion_tokens) if usage else (0, 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class Shape:
    """One endpoint's response shape: ``chat`` for /v1/chat/completions, else /v1/completions."""

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        reasoning: ReasoningParserName = "",
        tools: ToolMode | None = None,
    ):
        self.chat = chat
        self.reasoning = reasoning if chat else ""  # the chat answer's reasoning parser
        self.tools = tools  # how the chat answer's tool calls are read, if it may make any
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(
        self,
        text: str,
        finish_reason: str,
        usage: Usage | None,
        samples: list[Sample] | None = None,
        logprobs: dict[int, list[TokenLogprob]] | None = None,
    ) -> dict:
        """The non-streamed answer: one choice per sample; `logprobs` by sample when asked."""
        outcomes = (
            [(s.index, s.text, s.finish_reason) for s in samples]
            if samples
            else [(0, text, finish_reason)]
        )
        choices = [
            self._choice(
                i,
                t,
                FINISH.get(r, r),
                None if logprobs is None else self.logprobs(logprobs.get(i, [])),
            )
            for i, t, r in outcomes
        ]
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": usage_body(usage)}

    def _choice(self, index: int, text: str, finish: str, logprobs: dict | None) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": text}
            if self.reasoning:
                message["reasoning_content"], message["content"] = split(text, self.reasoning)
            if self.tools is not None:
                message["content"], calls = parse(message["content"], self.tools)
                if calls:
                    message["tool_calls"] = calls
                    message["content"] = message["content"] if message["content"].strip() else None
                    finish = tool_finish(finish, True)
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def logprobs(self, entries: list[TokenLogprob], offset: int = 0) -> dict:
        """The endpoint's logprobs object; `offset`: the legacy text_offset of the first."""
        if self.chat:
            return {"content": [_chat_entry(e) for e in entries], "refusal": None}
        tokens = [e.token or "" for e in entries]
        offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token or "": t.logprob for t in e.top_logprobs} for e in entries],
            "text_offset": offsets,
        }

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        *,
        first: bool = False,
        include_usage: bool = False,
        index: int = 0,
        logprobs: dict | None = None,
        reasoning: str = "",
        tool_calls: list[dict] | None = None,
    ) -> str:
        """One SSE event with new text of choice `index` (chat: ``first`` carries the role,
        `reasoning` is new reasoning text, in `reasoning_content`, and `tool_calls` are
        `delta.tool_calls` entries)."""
        finish = FINISH.get(finish_reason, finish_reason) if finish_reason else None
        if self.chat:
            delta = (
                {"role": "assistant", "content": text or ""}
                if first
                else ({"content": text} if text else {})
            )
            if reasoning:
                delta["reasoning_content"] = reasoning
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {
                "index": index,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": finish,
            }
            body = {**self._head("text_completion"), "choices": [choice]}
        if include_usage:
            body["usage"] = None  # as OpenAI: null on every chunk but the last
        return sse(body)

    def usage_chunk(self, usage: Usage | None) -> str:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self._head(obj), "choices": [], "usage": usage_body(usage)})


def tool_finish(finish: str, called: bool) -> str:
    """An answer that ended by itself after making calls finishes with `tool_calls`."""
    return "tool_calls" if called and finish == "stop" else finish


def _chat_entry(e: TokenLogprob) -> dict:
    return {
        "token": e.token or "",
        "logprob": e.logprob,
        "bytes": _bytes(e.token),
        "top_logprobs": [
            {"token": t.token or "", "logprob": t.logprob, "bytes": _bytes(t.token)}
            for t in e.top_logprobs
        ],
    }


def _bytes(token: str | None) -> list[int] | None:
    # A token holding part of a UTF-8 character reads as U+FFFD.
    return None if token is None or "\ufffd" in token else list(token.encode())


def sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


DONE = sse("[DONE]")
