"""Reasoning output: a reasoning model's thinking, between `<think>` and `</think>`, goes to
`reasoning_content`, the rest to `content` (INFERLINE_GATEWAY__REASONING_PARSER, as vLLM's
--reasoning-parser). Two families:

- `think` (Qwen3 and the like): the output opens the block itself; an output that does not begin
  with `<think>` is all answer.
- `deepseek_r1`: the chat template opened the block, so the output starts inside it (a `<think>`
  it repeats is dropped) and the answer follows `</think>`; an output that never closes it is all
  reasoning.
"""

from __future__ import annotations

from typing import Literal

OPEN, CLOSE = "<think>", "</think>"
ReasoningParserName = Literal["", "think", "deepseek_r1"]


class ReasoningSplitter:
    """Splits one choice's text, delta by delta, into (reasoning, content) deltas. Text that
    may be the start of a tag is held back until the next delta tells."""

    def __init__(self, parser: ReasoningParserName) -> None:
        # Where an output that does not open with `<think>` is: the template may have opened it.
        self._unopened = "inside" if parser == "deepseek_r1" else "after"
        self.state = "start"
        self.reasoned = parser == "deepseek_r1"  # a reasoning block was opened
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        reasoning = content = ""
        while text:
            if self.state == "after":
                return reasoning, content + text
            if self.state == "start":
                stripped = text.lstrip()
                if OPEN.startswith(stripped) and len(stripped) < len(OPEN):
                    self._held = text  # whitespace or a part of `<think>`: not known yet
                    return reasoning, content
                if not stripped.startswith(OPEN):
                    self.state = self._unopened
                    continue
                self.state, self.reasoned, text = "inside", True, stripped[len(OPEN) :]
                continue
            end = text.find(CLOSE)
            if end >= 0:
                reasoning += text[:end]
                self.state, text = "after", text[end + len(CLOSE) :]
                continue
            keep = _partial_suffix(text, CLOSE)
            reasoning, self._held = reasoning + text[: len(text) - keep], text[len(text) - keep :]
            return reasoning, content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the text has ended."""
        held, self._held = self._held, ""
        if self.state == "start":
            self.state = self._unopened
        return (held, "") if self.state == "inside" else ("", held)


def split(text: str, parser: ReasoningParserName) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer."""
    if not parser:
        return None, text
    splitter = ReasoningSplitter(parser)
    parts = [splitter.feed(text), splitter.finish()]
    reasoning = "".join(r for r, _ in parts) if splitter.reasoned else None
    return reasoning, "".join(c for _, c in parts)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
