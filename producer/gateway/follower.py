"""Reply events of every attempt -> the text an HTTP client has not been sent yet: a rerun's text
is held back until it passes what was sent; one that says something else ends the stream.
"""

from __future__ import annotations

from inferline.contract.schema import DoneEvent, TokensEvent


class Diverged(Exception):
    """A new attempt produced text that contradicts what was already sent."""


class TextFollower:
    """Follows the text of one sample (`index`: 0..n-1 of a request with n samples)."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.sent = ""
        self._attempt: str | None = None
        self._text = ""

    @property
    def caught_up(self) -> bool:
        """Everything the current attempt said is sent (False while a rerun catches up)."""
        return self._text == self.sent

    def feed(self, ev) -> str:
        """The new text to send for this event ("" if none); Diverged when it cannot be sent."""
        if ev.attempt != self._attempt:
            self._attempt, self._text = ev.attempt, ""
        whole = _whole_text(ev, self.index) if isinstance(ev, DoneEvent) else None
        if isinstance(ev, TokensEvent) and ev.index == self.index:
            self._text += ev.text
        elif whole is not None:
            self._text = whole  # also repairs a gap
        else:
            return ""
        if self._text.startswith(self.sent):
            new, self.sent = self._text[len(self.sent) :], self._text
            return new
        if self.sent.startswith(self._text):
            return ""  # a rerun still catching up
        raise Diverged(
            "the request was run again after a worker was lost, and the rerun's text differs"
        )


def _whole_text(done: DoneEvent, index: int) -> str | None:
    if done.samples:
        return next((s.text for s in done.samples if s.index == index), None)
    return done.text if index == 0 else None
