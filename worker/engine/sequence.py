"""A request's state inside the engine: token ids, counters, block table, status (counters, not
phases: docs/architecture.md#the-engine-step)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inferline.worker.engine.request import SamplingParams

if TYPE_CHECKING:  # the sampler imports torch and xgrammar
    from inferline.worker.engine.sampler import SeededStream


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# An output token sampled on the device and not read back yet (worker/engine/overlap.py).
PENDING = -1

# finish_reason (wire contract) -> error code, for reasons that are errors.
ERROR_CODE_OF = {"cancelled": "cancelled", "timeout": "timeout", "error": "internal"}


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.time)
    deadline: float | None = None
    stream: SeededStream | None = None  # a seeded request's draws so far: kept through preemption
    detokenizer: object | None = None  # IncrementalDetokenizer; None when text is not needed
    grammar: object | None = None  # xgrammar GrammarMatcher, once compiled
    mask_strikes: int = 0  # steps in a row this row's mask took over budget
    index: int = 0  # which of the request's n samples
    tenant: str = "default"  # whose share it counts in (the worker's tenancy decided it)

    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_freed_blocks: int = 0  # leading block_table entries freed behind a sliding window
    block_keys: list[bytes] = field(default_factory=list)  # memoized prefix-cache keys
    num_preemptions: int = 0
    finish_reason: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    first_scheduled_time: float | None = None
    last_scheduled_step: int = 0  # the step that last ran it (background turns)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, float]:
        """Lower is better: (priority, arrival)."""
        return (self.priority, self.arrival_time)

    def finish(self, reason: str, message: str | None = None, code: str | None = None) -> None:
        if self.output_token_ids[-1:] == [PENDING]:  # ended with a token in flight: never emitted
            self.output_token_ids.pop()
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.error_code = code or ERROR_CODE_OF.get(reason)
        self.error_message = message
        self.finish_time = time.time()
