"""Admission: a wire request becoming an engine request, with its capped tokens and deadline."""

from __future__ import annotations

from dataclasses import dataclass

from aiokafka import TopicPartition

from inferline.contract.schema import Request
from inferline.worker.engine.request import EngineRequest, SamplingParams, StructuredSpec


@dataclass(frozen=True)
class Admission:
    """A request the intake admitted."""

    tp: TopicPartition
    offset: int
    request: Request
    received: float  # Unix seconds
    max_tokens: int
    deadline: float  # Unix seconds

    def engine_request(self, attempt: str) -> EngineRequest:
        """The engine's request for one attempt (the engine's request id)."""
        return engine_request(self.request, attempt, self.max_tokens, self.received, self.deadline)


def deadline_of(req: Request, received: float, default_timeout_s: float) -> float:
    """Unix time by which the request must be done: from created_at (if past), else receipt."""
    start = min(req.created_at, received) if req.created_at is not None else received
    return start + (req.timeout_s if req.timeout_s is not None else default_timeout_s)


def capped_max_tokens(req: Request, settings) -> int:
    return min(req.max_tokens, settings.limits.max_tokens_cap)


def sample_budget_problem(req: Request, max_tokens: int, limits) -> str | None:
    """Why n x max_tokens (capped) is over INFERLINE_LIMITS__MAX_REQUEST_TOKENS, or None."""
    if req.n * max_tokens <= limits.max_request_tokens:
        return None
    field = "n" if req.n > 1 else "max_tokens"
    return (
        f"{field}: {req.n} samples x max_tokens {max_tokens} = {req.n * max_tokens} tokens, "
        f"at most {limits.max_request_tokens} per request"
    )


def engine_request(
    req: Request, attempt: str, max_tokens: int, received: float, deadline: float
) -> EngineRequest:
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        stop=tuple(req.stop),
        stop_token_ids=tuple(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        structured=StructuredSpec(*c) if (c := req.output_constraint()) else None,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        n=req.n,
    )
    messages = [m.model_dump() for m in req.messages] if req.messages is not None else None
    return EngineRequest(
        request_id=attempt,
        sampling=sampling,
        prompt=req.prompt,
        messages=messages,
        prompt_token_ids=req.prompt_token_ids,
        priority=req.priority,
        arrival_time=received,
        deadline=deadline,
        tenant=req.tenant,
    )
