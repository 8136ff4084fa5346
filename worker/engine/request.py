"""The engine's typed boundary: EngineRequest in, RequestOutput out; nothing else crosses
between the asyncio loop and the engine thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# Temperatures below this are greedy: dividing logits by them would overflow fp32.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class StructuredSpec:
    """The grammar a request's output must follow: `kind` (json_schema, json_object, regex,
    choice, grammar), `text` its source and cache key, `field` the wire field a rejection names."""

    field: str
    kind: str
    text: str


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # A set: every generated token is looked up in it.
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    structured: StructuredSpec | None = None
    logprobs: int | None = None  # None: off; k: the token's logprob and the k most likely
    n: int = 1  # samples of one prompt; sample i draws with seed + i
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # max_tokens was left out: the engine lowers it to what the model length leaves after the
    # prompt (max_tokens is then the worker's cap); else a max_tokens that cannot fit is rejected.
    fit_to_model_len: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """The one definition of greedy (argmax)."""
        return self.temperature < MIN_TEMPERATURE


@dataclass
class EngineRequest:
    """One request for the engine: exactly one of prompt / messages / prompt_token_ids; the
    engine thread tokenizes."""

    request_id: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt: str | None = None
    messages: list[dict] | None = None
    chat_template_kwargs: dict | None = None  # variables for the chat template
    tools: list[dict] | None = None  # functions the model may call, as OpenAI's `tools`
    tool_format: str = "hermes"  # how calls are shown where the template does not render tools
    prompt_token_ids: list[int] | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.time)  # Unix seconds
    deadline: float | None = None  # Unix seconds
    tenant: str | None = None  # grammar compiles take turns by tenant


@dataclass(frozen=True)
class SampleResult:
    """One sample's outcome, in the final output of a request with n > 1."""

    index: int
    text: str
    finish_reason: str
    num_output_tokens: int


@dataclass
class RequestOutput:
    """What one engine step did to one request: `started` on its first step, `finished` exactly
    once. With n > 1, one output per sample that moved; the final one lists every sample."""

    request_id: str
    index: int = 0
    new_token_ids: list[int] = field(default_factory=list)
    # With logprobs: wire-shaped TokenLogprob dicts aligned with new_token_ids.
    logprobs: list[dict] | None = None
    text_delta: str = ""
    started: bool = False
    finished: bool = False
    finish_reason: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    text: str | None = None  # the whole output, when finished
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    queue_s: float = 0.0
    ttft_s: float | None = None
    total_s: float = 0.0
    samples: list[SampleResult] | None = None  # n > 1, when finished: every sample
