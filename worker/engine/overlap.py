"""Overlapped steps: step N+1 is scheduled and launched while step N's sampled tokens are still on
the device, so the host's work per step (update, detokenize, schedule, prepare) hides behind the
device's (INFERLINE_ENGINE__OVERLAP). design: docs/architecture.md#the-engine-step

Each sequence that samples in a step left in flight ends its output with a PENDING token: the
scheduler sees the token it will have. The next step's decode rows take that token on the device,
a gather from the step in flight's sampled ids (`pending_rows`); the step in flight is resolved
(tokens read back, appended, detokenized, stops) only after the next one is launched. A sequence
that step N ends had a wasted row in step N+1: it has finished when N+1 resolves, and that row's
token is dropped. Its blocks are freed when N resolves, while N+1 may still write that row's K/V:
safe, since whatever reuses them is launched later on the same stream. A sequence that its token
in flight certainly ends (max_tokens, the model length) sits the next step out (Scheduler.hold).
"""

from __future__ import annotations

from inferline.worker.engine.sampler import has_penalties
from inferline.worker.engine.scheduler import ScheduledSequence
from inferline.worker.engine.sequence import PENDING, Sequence
from inferline.worker.engine.spec_decode import can_speculate


def pick_overlap(name: str, device_type: str) -> bool:
    """settings.engine.overlap: `auto` is on with CUDA only (torch's CPU ops run synchronously:
    the host has no device time to hide behind)."""
    assert name in ("auto", "on", "off"), f"overlap must be auto, on or off, got {name!r}"
    return device_type == "cuda" if name == "auto" else name == "on"


def serial_reason(seq: Sequence, speculative: bool) -> str | None:
    """Why a step that samples `seq` must be resolved before the next is scheduled; None when it
    may stay in flight."""
    params = seq.sampling
    if params.structured is not None:
        return "grammar"  # the next mask needs this token accepted by the matcher, on the host
    if has_penalties(params):
        return "penalties"  # they count the output ids, this token among them
    if params.logprobs is not None:
        return "logprobs"  # the sampler reads them back itself: nothing is left to overlap
    if params.n > 1:
        return "n > 1"  # sample 0 forks its siblings at its update (LLMEngine._fork)
    if speculative and can_speculate(params):
        return "speculative"  # drafts follow the last token; the accepted count is the host's
    return None


def can_overlap(scheduled: list[ScheduledSequence], speculative: bool) -> bool:
    """Whether the step of `scheduled` may stay in flight while the next one is scheduled."""
    return all(
        not s.spec_token_ids and serial_reason(s.seq, speculative) is None for s in scheduled
    )


def reads_pending(chunk: ScheduledSequence) -> bool:
    """Whether `chunk` computes its sequence's PENDING token (then it is the chunk's last row)."""
    return chunk.seq.output_token_ids[-1:] == [PENDING] and chunk.samples


def needs_tokens_first(scheduled: list[ScheduledSequence]) -> bool:
    """A chunk of several rows reads a PENDING token (a preempted sequence taken back at once):
    only decode rows gather on the device, so the step in flight is resolved first."""
    return any(s.num_new_tokens > 1 and reads_pending(s) for s in scheduled)


def pending_rows(
    ordered: list[ScheduledSequence], rows_of: dict[int, int]
) -> tuple[list[int], list[int]]:
    """(input rows, rows of the step in flight's sampled ids, by id(seq) in `rows_of`) of the
    decodes whose input token is PENDING. A batch puts its decodes first, one row each."""
    dst, src = [], []
    for i, s in enumerate(ordered):
        if s.num_new_tokens != 1:
            break
        if reads_pending(s):
            dst.append(i)
            src.append(rows_of[id(s.seq)])
    return dst, src
