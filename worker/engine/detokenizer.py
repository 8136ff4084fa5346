"""Incremental detokenization with stop strings (design: docs/architecture.md#the-engine-step)."""

from __future__ import annotations

from collections.abc import Sequence

_REPLACEMENT = "\ufffd"


class StopChecker:
    """Streams text through stop strings: `feed` returns what is safe to emit. Output stops at
    the earliest-ending match (the longest among ties), whatever the token boundaries."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(s for s in stop if s)
        self.stopped = False
        self._pending = ""  # a suffix that is a proper prefix of a stop string

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        pending = self._pending + text
        cut = self._first_match(pending)
        if cut is not None:
            self.stopped = True
            self._pending = ""
            return pending[:cut]
        held = self._held_length(pending)
        self._pending = pending[len(pending) - held :]
        return pending[: len(pending) - held]

    def flush(self) -> str:
        """Releases the held text."""
        pending, self._pending = self._pending, ""
        return "" if self.stopped else pending

    def _first_match(self, text: str) -> int | None:
        # A match cannot start in emitted text (it would have been held): pending text suffices.
        best: tuple[int, int] | None = None  # (end, start)
        for s in self.stop:
            start = text.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best):
                best = (start + len(s), start)
        return None if best is None else best[1]

    def _held_length(self, text: str) -> int:
        # The longest suffix of text that is a proper prefix of a stop string.
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held


class TokenTexts:
    """Each token's own text (logprobs' `token`), decoded once per id; a partial UTF-8 character
    reads as U+FFFD."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # at most the vocabulary

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode(
                [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        return text

    def name(self, logprobs: dict) -> dict:
        """The sampler's logprobs entry with `token` set on it and each top entry."""
        for top in logprobs["top_logprobs"]:
            top["token"] = self(top["token_id"])
        return logprobs


class IncrementalDetokenizer:
    """Turns a sequence's output token ids into text deltas, one token at a time: all deltas plus
    `flush()` equal decode(output_ids) cut before the first stop string."""

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
        # token_ids[:read_offset] are passed on; prefix_offset is a clean character boundary at or
        # before it, and _window_text = decode(ids[prefix:read]).
        self._prefix_offset = 0
        self._read_offset = 0
        self._window_text = ""

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    @property
    def text(self) -> str:
        return "".join(self._text_parts)

    def add(self, token_id: int) -> tuple[str, bool]:
        """Appends one token; returns (text delta safe to emit now, stopped)."""
        if self.stopped:
            return "", True
        self.token_ids.append(token_id)
        return self._emit(self._stop.feed(self._decode_new(final=False))), self.stopped

    def flush(self) -> str:
        """Emits everything held back; call when the sequence ends other than by a stop string."""
        if self.stopped:
            return ""
        text = self._stop.feed(self._decode_new(final=True))
        return self._emit(text + self._stop.flush())

    def _decode_new(self, final: bool) -> str:
        """Text of the tokens past read_offset; "" while it ends in an unfinished character."""
        window = self._decode(self.token_ids[self._prefix_offset :])
        if not final and (len(window) <= len(self._window_text) or window.endswith(_REPLACEMENT)):
            return ""  # nothing new, or a character still incomplete
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
