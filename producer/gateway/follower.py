"""Reply events of every attempt -> the text an HTTP client has not been sent yet.

An HTTP stream cannot take back what it sent. When a worker dies mid-generation and another
runs the request again (a new `attempt`), the rerun's text is held back until it passes what
was already sent (a greedy or seeded rerun gives the same text); a rerun that says something
else cannot be shown, and the stream ends with an error.
"""
from __future__ import annotations

from producer.schema import DoneEvent, TokensEvent


class Diverged(Exception):
    """A new attempt produced text that contradicts what was already sent."""


class TextFollower:
    def __init__(self) -> None:
        self.sent = ""
        self._attempt: str | None = None
        self._text = ""  # the current attempt's text so far

    def feed(self, ev) -> str:
        """The new text to send for this event ("" if none); Diverged when it cannot be sent."""
        if ev.attempt != self._attempt:
            self._attempt, self._text = ev.attempt, ""
        if isinstance(ev, TokensEvent):
            self._text += ev.text
        elif isinstance(ev, DoneEvent) and ev.text is not None:
            self._text = ev.text  # the whole text: also repairs a gap in the events
        else:
            return ""
        if self._text.startswith(self.sent):
            new, self.sent = self._text[len(self.sent):], self._text
            return new
        if self.sent.startswith(self._text):
            return ""  # a rerun still catching up
        raise Diverged("the request was run again after a worker was lost, and the rerun's text differs")
