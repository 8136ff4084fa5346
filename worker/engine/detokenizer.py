"""Incremental detokenization with stop strings.

Two hold-backs sit between the token ids and the emitted text:

1. UTF-8: a byte-level token may end in the middle of a character; decode then ends in U+FFFD.
   Those tokens wait until a later token completes the character (or until `flush`).
2. Stop strings: text that could still be the start of a stop string waits until it cannot be;
   a stop string itself, and everything after it, is never emitted.

Decoding uses a sliding window (vLLM's prefix_offset / read_offset): only the tokens since the
last clean character boundary are decoded each step, so a token costs O(1), not O(output).
"""
from __future__ import annotations

from collections.abc import Sequence

_REPLACEMENT = "\ufffd"


class StopChecker:
    """Streams text through a set of stop strings: `feed` returns what is safe to emit.

    The output stops at the first stop string to complete (the earliest end in the text; among
    matches ending together, the longest), matching what a token-by-token check would find
    whatever the token boundaries are. Empty stop strings are ignored."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(s for s in stop if s)
        self.stopped = False
        self._pending = ""  # a suffix that is a proper prefix of some stop string

    def feed(self, text: str) -> str:
        """Takes new text; returns the part that can be emitted now."""
        if self.stopped:
            return ""
        pending = self._pending + text
        cut = self._first_match(pending)
        if cut is not None:
            self.stopped = True
            self._pending = ""
            return pending[:cut]
        held = self._held_length(pending)
        self._pending = pending[len(pending) - held:]
        return pending[: len(pending) - held]

    def flush(self) -> str:
        """Releases the held text (it can no longer become a stop string)."""
        pending, self._pending = self._pending, ""
        return "" if self.stopped else pending

    def _first_match(self, text: str) -> int | None:
        # No match can start in text already emitted (it would have been held), so searching the
        # pending text alone is complete.
        best: tuple[int, int] | None = None  # (end, start)
        for s in self.stop:
            start = text.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best):
                best = (start + len(s), start)
        return None if best is None else best[1]

    def _held_length(self, text: str) -> int:
        # The longest suffix of text that is a proper prefix of a stop string: every position that
        # could still begin a match lies inside it.
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held


class TokenTexts:
    """Each token's own text, the name logprobs give it (OpenAI's `token`), decoded once per id.
    A token holding part of a UTF-8 character reads as U+FFFD here; the stream's text is exact."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # at most the vocabulary

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode(
                [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text

    def name(self, logprobs: dict) -> dict:
        """The sampler's logprobs entry with `token` set on it and on each top entry."""
        for top in logprobs["top_logprobs"]:
            top["token"] = self(top["token_id"])
        return logprobs


class IncrementalDetokenizer:
    """Turns a sequence's output token ids into text deltas, one token at a time.

    The concatenation of every delta and the final `flush()` equals
    `tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`
    cut right before the first stop string to complete. The text is that of the output alone
    (what HF `generate` + `decode` of the new tokens gives); `prompt_token_ids` is accepted for
    the engine's interface and not used as decoding context."""

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._stop = StopChecker(stop)
        self._text_parts: list[str] = []
        # token_ids[:read_offset] are decoded and passed on; prefix_offset is a clean character
        # boundary at or before read_offset, and _window_text = decode(ids[prefix:read]).
        self._prefix_offset = 0
        self._read_offset = 0
        self._window_text = ""

    @property
    def stopped(self) -> bool:
        """True once a stop string matched; later tokens add no text."""
        return self._stop.stopped

    @property
    def text(self) -> str:
        """Everything emitted so far (deltas and flush)."""
        return "".join(self._text_parts)

    def add(self, token_id: int) -> tuple[str, bool]:
        """Appends one token; returns (text delta safe to emit now, stopped)."""
        if self.stopped:
            return "", True
        self.token_ids.append(token_id)
        return self._emit(self._stop.feed(self._decode_new(final=False))), self.stopped

    def flush(self) -> str:
        """Emits everything held back (an unfinished character as U+FFFD, a possible stop-string
        prefix as is); call when the sequence finishes for a reason other than a stop string."""
        if self.stopped:
            return ""
        text = self._stop.feed(self._decode_new(final=True))
        return self._emit(text + self._stop.flush())

    def _decode_new(self, final: bool) -> str:
        """Text of the tokens past read_offset, or "" while it ends in an unfinished character."""
        window = self._decode(self.token_ids[self._prefix_offset :])
        if not final and (len(window) <= len(self._window_text) or window.endswith(_REPLACEMENT)):
            return ""  # nothing new (a skipped special token), or a character still incomplete
        # decode(ids[prefix:read]) ends on a whole character, so it is a prefix of `window`.
        delta = window[len(self._window_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self._window_text = delta
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _emit(self, text: str) -> str:
        if text:
            self._text_parts.append(text)
        return text
