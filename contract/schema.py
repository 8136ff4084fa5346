"""The inferline wire contract v1 (docs/protocol.md): typed models and their codec (msgpack, the
default, or JSON, as a record's `content-type` header says), shared by both sides; bad requests
raise ``UndecodableMessage`` or ``InvalidRequest``.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Union

import msgpack
from pydantic import (
    AfterValidator,
    BeforeValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

PROTOCOL_VERSION = 1
# The encodings of the contract: a record's `content-type` header names one (msgpack without it),
# and every event written for a request carries the request's.
MSGPACK, JSON = "application/msgpack", "application/json"
CONTENT_TYPES = (MSGPACK, JSON)
CONTENT_TYPE_HEADER = "content-type"
# The broker's default message.max.bytes, as KafkaSettings.max_message_bytes.
DEFAULT_MAX_MESSAGE_BYTES = 1_048_576
MAX_ID_LEN = 128
MAX_TOPIC_LEN = 249
# Caps on what a producer controls (`prompt` and `content`: the message size and max_model_len);
# over one, a `rejected` done names the field.
# OpenAI and TGI allow 4 stop strings, vLLM any number; 16 leaves room.
MAX_STOP = 16
# Stop markers are short; the held-prefix check costs O(length^2) per token at worst.
MAX_STOP_LEN = 128
# 1024 covers a whole class of tokens (every newline or end-of-turn variant).
MAX_STOP_TOKEN_IDS = 1024
# The longest context windows offered (1M tokens); max_model_len is the real limit.
MAX_PROMPT_TOKEN_IDS = 1_048_576
# A long agent conversation with tool calls.
MAX_MESSAGES = 2048
# Roles are words (system, user, assistant, tool, ...).
MAX_ROLE_LEN = 64
# No vocabulary comes near it; ids fit an int32 in every client.
MAX_TOKEN_ID = 2**31 - 1
# int64 (as vLLM) and uint64 (as TGI); the sampler reads a seed mod 2**64.
SEED_RANGE = (-(2**63), 2**64 - 1)
# A documented range for scheduling classes; per-tenant clamps narrow it.
PRIORITY_RANGE = (-1000, 1000)
# A day: a request still waiting after that is lost, not late.
MAX_TIMEOUT_S = 86_400.0
# Far above any real partition count; a bound JSON clients can check.
MAX_REPLY_PARTITION = 99_999
# metadata size = UTF-8 bytes of every key and value.
MAX_METADATA_BYTES = 4096
# A few dozen keys; the byte cap alone would allow thousands of tiny ones.
MAX_METADATA_KEYS = 64
MAX_TENANT_LEN = 256
# A JSON schema (compact JSON), a regex or an EBNF grammar: compile time grows with its size.
MAX_GRAMMAR_BYTES = 65_536
# Nesting of a JSON schema's containers (each property level is two: `properties` and the schema).
MAX_SCHEMA_DEPTH = 64
# vLLM's choice: one grammar alternative each; together they count against MAX_GRAMMAR_BYTES.
MAX_CHOICES = 256
MAX_CHOICE_LEN = 1024
# OpenAI's cap on top_logprobs.
MAX_TOP_LOGPROBS = 20
# Samples per request: each costs its own decode tokens (the prompt is computed once).
MAX_N = 16
# OpenAI's caps on logit_bias: entries, and each bias (added to a logit before sampling).
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = (-100, 100)
# The tool calls of one assistant turn (parallel calls), and a call's or a function's name
# (OpenAI's function names: 1-64 of a-z, A-Z, 0-9, '_', '-').
MAX_TOOL_CALLS = 128
MAX_TOOL_CALL_ID_LEN = 128
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
# Functions offered to the model (OpenAI allows 128) and a function's description.
MAX_TOOLS = 128
MAX_TOOL_DESCRIPTION_LEN = 4096
# How the model writes a call where its chat template does not render tools (docs/gateway.md).
ToolFormat = Literal["hermes", "llama3_json"]
TOOL_FORMATS: tuple[str, ...] = ToolFormat.__args__
# Variables for the chat template (Qwen3's enable_thinking, ...): a few short values.
MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_VALUE_LEN = 256
# Arguments of apply_chat_template that are the worker's, not the template's.
RESERVED_TEMPLATE_KWARGS = frozenset(
    "conversation messages tools documents chat_template add_generation_prompt "
    "continue_final_message tokenize padding truncation max_length return_tensors return_dict "
    "return_assistant_tokens_mask tokenizer_kwargs".split()
)

FinishReason = Literal["stop", "length", "cancelled", "timeout", "rejected", "requeued", "error"]
ErrorCode = Literal[
    "invalid_request",
    "prompt_too_long",
    "rate_limited",
    "overloaded",
    "timeout",
    "cancelled",
    "internal",
    "answered_before",
]
EventType = Literal["started", "tokens", "done"]
FINISH_REASONS: tuple[str, ...] = FinishReason.__args__
ERROR_CODES: tuple[str, ...] = ErrorCode.__args__
EVENT_TYPES: tuple[str, ...] = EventType.__args__

ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Tenants key rate limits, logs and topic prefixes: the id characters only.
TENANT_PATTERN = r"^[A-Za-z0-9._:-]+$"
TOPIC_RE = re.compile(r"[a-zA-Z0-9._-]{1,249}")
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")


# ---------------------------------------------------------------------------------------------
# Exceptions


class UndecodableMessage(Exception):
    """The bytes cannot be decoded far enough to answer the sender: dead-letter them."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class InvalidRequest(Exception):
    """A decodable request with a usable id and reply topic that breaks a rule of the contract.

    ``field``: the top-level field at fault; ``path``: its location (``"messages.0.role"``);
    ``code``: ``invalid_request`` or ``prompt_too_long``; ``reply_partition``: None if unusable;
    ``content_type``: the request's encoding, which its `done` takes."""

    def __init__(
        self,
        field: str,
        message: str,
        *,
        request_id: str,
        reply_topic: str,
        reply_partition: int | None = None,
        code: ErrorCode = "invalid_request",
        path: str | None = None,
        content_type: str = MSGPACK,
    ):
        super().__init__(message)
        self.content_type = content_type  # the request's encoding: its rejection's too
        self.field = field
        self.path = path or field
        self.message = message
        self.request_id = request_id
        self.reply_topic = reply_topic
        self.reply_partition = reply_partition
        self.code = code


# ---------------------------------------------------------------------------------------------
# Field types


def _not_bool(value: Any) -> Any:
    # Literal[1] would accept True; the contract's `v` is an int.
    if isinstance(value, bool):
        raise ValueError("must be an int, not a bool")
    return value


def _legal_topic(s: str) -> str:
    if not is_legal_topic(s):
        raise ValueError("not a legal Kafka topic name (1-249 of [a-zA-Z0-9._-], not '.' or '..')")
    return s


def _utf8(s: str) -> str:
    # Plain `str` accepts lone surrogates, which can be neither encoded nor tokenized.
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid UTF-8") from None
    return s


def _token_id_key(s: str) -> str:
    # JSON keys are strings: a token id in decimal, as OpenAI's logit_bias.
    if not (s.isascii() and s.isdigit() and len(s) <= 10 and int(s) <= MAX_TOKEN_ID):
        raise ValueError(f"must be a token id in decimal, 0 to {MAX_TOKEN_ID}")
    return s


def _legal_id(s: str) -> str:
    if not is_legal_id(s):
        raise ValueError("must be 1-128 characters of [A-Za-z0-9._:-]")
    return s


# pydantic rejects str with lone surrogates, so anything that validates encodes as UTF-8.
NonEmptyText = Annotated[str, Field(min_length=1)]
Utf8Text = Annotated[str, AfterValidator(_utf8)]
Version = Annotated[Literal[1], BeforeValidator(_not_bool)]
RequestId = Annotated[str, AfterValidator(_legal_id)]
TopicName = Annotated[str, AfterValidator(_legal_topic)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Seconds = Annotated[float, Field(ge=0)]
TokenIdKey = Annotated[str, AfterValidator(_token_id_key)]
Bias = Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]


def is_legal_id(value: object) -> bool:
    """A str of 1-128 characters of [A-Za-z0-9._:-]."""
    return type(value) is str and ID_RE.fullmatch(value) is not None


def is_legal_topic(value: object) -> bool:
    """A legal Kafka topic name: 1-249 of [a-zA-Z0-9._-], not "." or ".."."""
    return type(value) is str and TOPIC_RE.fullmatch(value) is not None and value not in (".", "..")


class _Wire(BaseModel):
    # strict: no coercions; extra ignored: newer producers may add optional fields.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


# ---------------------------------------------------------------------------------------------
# Request and cancel


TEMPLATE_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
TemplateValue = Union[
    bool, int, float, Annotated[Utf8Text, Field(max_length=MAX_TEMPLATE_VALUE_LEN)]
]


class ToolCallFunction(_Wire):
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    arguments: Utf8Text  # JSON text, as the model wrote it


class ToolCall(_Wire):
    """A function call the assistant made in an earlier turn."""

    id: Annotated[NonEmptyText, Field(max_length=MAX_TOOL_CALL_ID_LEN)]
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Wire):
    """One turn. An assistant turn may carry the `tool_calls` it made, a `tool` turn the
    `tool_call_id` it answers; `name` names the speaker. A field this contract does not know is
    refused by name, not dropped: a conversation must reach the model whole."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    role: Annotated[NonEmptyText, Field(max_length=MAX_ROLE_LEN)]
    content: Utf8Text
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(min_length=1, max_length=MAX_TOOL_CALLS)] | None = (
        None
    )
    tool_call_id: Annotated[NonEmptyText, Field(max_length=MAX_TOOL_CALL_ID_LEN)] | None = None

    @model_validator(mode="after")
    def _turn_fields(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant turn makes tool calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("tool_call_id: a tool turn, and only a tool turn, answers a call")
        return self

    def template_dict(self) -> dict:
        """The turn as chat templates read it (transformers' convention): absent fields left
        out, a call's arguments as an object where they are a JSON object."""
        turn = self.model_dump(exclude_none=True)
        for call in turn.get("tool_calls", []):
            parsed = json_object(call["function"]["arguments"])
            if parsed is not None:
                call["function"]["arguments"] = parsed
        return turn


def json_object(text: str) -> dict | None:
    """`text` parsed, when it is a JSON object; else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _grammar_size(text: str) -> str:
    size = len(text.encode("utf-8"))
    if size > MAX_GRAMMAR_BYTES:
        raise ValueError(f"is {size} bytes, at most {MAX_GRAMMAR_BYTES} allowed")
    return text


def _json_text(value: dict) -> str:
    """The schema as canonical compact JSON: the grammar cache's key and the compiler's input."""
    try:
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=False
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"must be JSON ({exc})"[:200]) from None


GrammarText = Annotated[Utf8Text, Field(min_length=1), AfterValidator(_grammar_size)]


def _bounded_schema(value: dict) -> dict:
    # A JSON schema's caps: it may become a grammar.
    depth = json_depth(value, MAX_SCHEMA_DEPTH)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"nests deeper than {MAX_SCHEMA_DEPTH} levels")
    _grammar_size(_json_text(value))
    return value


class FunctionDefinition(_Wire):
    """A function the model may call (OpenAI's `tools[].function`)."""

    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    description: Annotated[Utf8Text, Field(max_length=MAX_TOOL_DESCRIPTION_LEN)] | None = None
    parameters: Annotated[dict, AfterValidator(_bounded_schema)] | None = None
    strict: bool | None = None


class Tool(_Wire):
    """One tool offered to the model: a function."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class JsonSchemaFormat(_Wire):
    """OpenAI's ``response_format.json_schema``: the output is JSON valid against ``schema``."""

    # `schema` would shadow a BaseModel attribute: an alias keeps the wire name.
    model_config = ConfigDict(
        strict=True,
        allow_inf_nan=False,
        extra="ignore",
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    schema_: Annotated[dict, Field(alias="schema")] = {}
    strict: bool | None = None
    description: Annotated[Utf8Text, Field(max_length=MAX_CHOICE_LEN)] | None = None

    @field_validator("schema_")
    @classmethod
    def _schema_size(cls, value: dict) -> dict:
        return _bounded_schema(value)


class ResponseFormat(_Wire):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object)
    or ``json_schema`` (``json_schema`` required)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class StructuredOutputs(_Wire):
    """vLLM's structured outputs: exactly one of ``regex``, ``choice`` (one of these strings) and
    ``grammar`` (EBNF, xgrammar's GBNF dialect)."""

    regex: GrammarText | None = None
    choice: (
        Annotated[
            list[Annotated[NonEmptyText, AfterValidator(_utf8), Field(max_length=MAX_CHOICE_LEN)]],
            Field(min_length=1, max_length=MAX_CHOICES),
        ]
        | None
    ) = None
    grammar: GrammarText | None = None

    @field_validator("choice")
    @classmethod
    def _choice_size(cls, value: list[str] | None) -> list[str] | None:
        # The options become one grammar: they count against the size cap together.
        if value is not None:
            _grammar_size(json.dumps(value, ensure_ascii=False))
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        if sum(getattr(self, f) is not None for f in ("regex", "choice", "grammar")) != 1:
            raise ValueError("exactly one of regex, choice, grammar is required")
        return self


class Request(_Wire):
    """One generation request (docs/protocol.md, "Request"). Exactly one of ``prompt``,
    ``messages``, ``prompt_token_ids`` is set. None means "none" (``timeout_s`` None: the
    worker's default)."""

    v: Version = PROTOCOL_VERSION
    id: RequestId
    reply_topic: TopicName
    reply_partition: Annotated[int, Field(ge=0, le=MAX_REPLY_PARTITION)] | None = None
    # An empty prompt gives the model nothing to continue from.
    prompt: NonEmptyText | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = (
        None
    )
    prompt_token_ids: (
        Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)] | None
    ) = None
    # None: what the model length leaves after the prompt, at most the worker's cap.
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] = 1.0
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    # An empty stop string would match before the first token.
    stop: Annotated[
        list[Annotated[NonEmptyText, Field(max_length=MAX_STOP_LEN)]], Field(max_length=MAX_STOP)
    ] = []
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] = []
    ignore_eos: bool = False
    priority: Annotated[int, Field(ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])] = 0
    timeout_s: Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S)] | None = None
    created_at: Annotated[float, Field(ge=0)] | None = None
    tenant: Annotated[
        str, Field(min_length=1, max_length=MAX_TENANT_LEN, pattern=TENANT_PATTERN)
    ] = "default"
    stream: bool = True
    metadata: Annotated[dict[Utf8Text, Utf8Text], Field(max_length=MAX_METADATA_KEYS)] = {}
    response_format: ResponseFormat | None = None
    structured: StructuredOutputs | None = None  # after response_format: its validator reads it
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # after logprobs
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    logit_bias: Annotated[dict[TokenIdKey, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    chat_template_kwargs: (
        Annotated[dict[str, TemplateValue], Field(max_length=MAX_TEMPLATE_KWARGS)] | None
    ) = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_format: ToolFormat = "hermes"

    @field_validator("tools")
    @classmethod
    def _distinct_tools(cls, value: list[Tool] | None, info) -> list[Tool] | None:
        if value is not None and info.data.get("messages") is None:
            raise ValueError("only with messages (the chat template shows the tools)")
        names = [t.function.name for t in value or ()]
        if len(set(names)) != len(names):
            raise ValueError("function names must be distinct")
        return value

    # Not a field: the encoding the request came in (decode_request sets it), its events' too.
    _content_type: str = PrivateAttr(default=MSGPACK)

    @property
    def content_type(self) -> str:
        """The request's encoding (MSGPACK or JSON): every event written for it takes it."""
        return self._content_type

    def route(self) -> dict:
        """Where its answer goes, as InvalidRequest's keyword arguments."""
        return dict(
            request_id=self.id,
            reply_topic=self.reply_topic,
            reply_partition=self.reply_partition,
            content_type=self.content_type,
        )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value):
        for name in value or ():
            if not TEMPLATE_KEY_RE.fullmatch(name):
                raise ValueError(f"{name[:64]!r}: 1-64 of letters, digits and _, not first a digit")
        reserved = sorted(set(value or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"{reserved[0]}: an argument of the worker's, not the template's")
        return value

    @field_validator("structured")
    @classmethod
    def _one_constraint(cls, value, info):
        fmt = info.data.get("response_format")
        if value is not None and fmt is not None and fmt.type != "text":
            raise ValueError("only one of response_format and structured may constrain the output")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _logprobs_on(cls, value, info):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("requires logprobs: true")
        return value

    def output_constraint(self) -> tuple[str, str, str] | None:
        """(field, kind, text) of the grammar the output must follow, or None: ``kind`` is
        json_schema, json_object, regex, choice or grammar; ``text`` its canonical source."""
        fmt, s = self.response_format, self.structured
        if fmt is not None and fmt.type == "json_schema":
            return "response_format", "json_schema", _json_text(fmt.json_schema.schema_)
        if fmt is not None and fmt.type == "json_object":
            return "response_format", "json_object", ""
        if s is None:
            return None
        if s.choice is not None:
            return "structured", "choice", json.dumps(s.choice, ensure_ascii=False)
        return (
            ("structured", "regex", s.regex)
            if s.regex is not None
            else ("structured", "grammar", s.grammar)
        )

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, value: dict[str, str]) -> dict[str, str]:
        size = metadata_bytes(value)
        if size > MAX_METADATA_BYTES:
            raise ValueError(
                f"is {size} bytes, at most {MAX_METADATA_BYTES} allowed (UTF-8 keys + values)"
            )
        return value

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> "Request":
        problem = prompt_fields_problem([f for f in PROMPT_FIELDS if getattr(self, f) is not None])
        if problem:
            raise ValueError(problem[1])
        return self


class Cancel(_Wire):
    """Ask every worker to stop request ``id`` (sent to the cancel topic, keyed by id)."""

    v: Version = PROTOCOL_VERSION
    id: RequestId


def json_depth(value: Any, stop: int) -> int:
    """Nesting depth of dicts and lists in `value` (a scalar is 0), no further than `stop` + 1."""
    depth, level = 0, [value]
    while depth <= stop:
        containers = [v for v in level if isinstance(v, (dict, list))]
        if not containers:
            break
        depth += 1
        level = [c for v in containers for c in (v.values() if isinstance(v, dict) else v)]
    return depth


def metadata_bytes(metadata: dict[str, str]) -> int:
    """Metadata size against the 4 KiB limit: UTF-8 bytes of all keys and values."""
    return sum(
        len(k.encode("utf-8", "surrogateescape")) + len(v.encode("utf-8", "surrogateescape"))
        for k, v in metadata.items()
    )


def prompt_fields_problem(present: list[str]) -> tuple[str, str] | None:
    if not present:
        return "prompt", "one of prompt, messages, prompt_token_ids is required"
    if len(present) > 1:
        return present[
            1
        ], f"only one of prompt, messages, prompt_token_ids may be set (got {', '.join(present)})"
    return None


# ---------------------------------------------------------------------------------------------
# Events


class Usage(_Wire):
    prompt_tokens: Annotated[int, Field(ge=0)]
    completion_tokens: Annotated[int, Field(ge=0)]


class Timing(_Wire):
    queue_s: Seconds
    ttft_s: Seconds | None  # None when no token was produced
    total_s: Seconds


class ErrorInfo(_Wire):
    code: ErrorCode
    message: str


class _EventBase(_Wire):
    v: Version = PROTOCOL_VERSION
    id: str
    attempt: str  # opaque, new for each execution of the request
    seq: Annotated[int, Field(ge=0)]  # 0, 1, 2, ... within one attempt


class StartedEvent(_EventBase):
    """First event of every attempt: the request entered the running batch."""

    type: Literal["started"] = "started"
    worker: str
    queue_s: Seconds


class TopLogprob(_Wire):
    token_id: int
    logprob: float
    token: str | None = None  # the token's own text (None from workers older than this field)


class TokenLogprob(_Wire):
    """One generated token's log-probability and the most likely alternatives (best first)."""

    logprob: float
    top_logprobs: list[TopLogprob] = []
    token: str | None = None  # the generated token's own text


class TokensEvent(_EventBase):
    """New tokens of one attempt and the text they add (only the new text). ``logprobs`` is
    aligned with ``token_ids`` when the request asked for them, else nil. ``index`` is the
    sample they belong to (0..n-1; always 0 when n is 1)."""

    type: Literal["tokens"] = "tokens"
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    index: Annotated[int, Field(ge=0)] = 0


class Sample(_Wire):
    """One sample's outcome in the ``done`` of a request with n > 1."""

    index: Annotated[int, Field(ge=0)]
    text: str
    finish_reason: FinishReason
    completion_tokens: Annotated[int, Field(ge=0)]


class DoneEvent(_EventBase):
    """Last event of every attempt, exactly once. ``text`` is the whole output (always set
    when the request had ``stream=False``); ``error`` is set for rejected/error outcomes."""

    type: Literal["done"] = "done"
    finish_reason: FinishReason
    usage: Usage
    timing: Timing
    text: str | None = None
    error: ErrorInfo | None = None
    metadata: dict[str, str] = {}
    # Who answered (optional: older workers leave it out).
    worker: str | None = None
    samples: list[Sample] | None = None  # n > 1: every sample, by index


Event = Annotated[Union[StartedEvent, TokensEvent, DoneEvent], Field(discriminator="type")]
_EVENT = TypeAdapter(Event)


# ---------------------------------------------------------------------------------------------
# Codec


def _sized(data: Any, max_bytes: int) -> None:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise UndecodableMessage(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise UndecodableMessage(f"message is {len(data)} bytes, over the {max_bytes}-byte limit")


def _unpack(data: Any, max_bytes: int) -> Any:
    """msgpack bytes -> Python objects, never decoding more than ``max_bytes``.

    The size bounds every length; deep nesting is UndecodableMessage. Bad UTF-8 is kept
    (surrogateescape) so its field fails validation: a `rejected` reply, not a dead letter."""
    _sized(data, max_bytes)
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            unicode_errors="surrogateescape",
            use_list=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_ext_len=max_bytes,
            max_array_len=max_bytes,
            max_map_len=max_bytes // 2,
        )
    except (ValueError, TypeError, RecursionError, MemoryError, msgpack.UnpackException) as exc:
        hint = " (a JSON record needs the header content-type: application/json)"
        hint = hint if sniff(data) == JSON else ""
        raise UndecodableMessage(f"not msgpack: {type(exc).__name__}: {exc}"[:300] + hint) from None


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


def _parse_json(data: Any, max_bytes: int) -> Any:
    """JSON (RFC 8259) bytes -> Python objects, under the msgpack path's rules: the same size cap,
    deep nesting UndecodableMessage (RecursionError), bad UTF-8 inside a string kept
    (surrogateescape) so its field fails validation. NaN and Infinity are not JSON."""
    _sized(data, max_bytes)
    try:
        text = bytes(data).decode("utf-8", "surrogateescape")
        return json.loads(text, parse_constant=_not_json)
    except (ValueError, RecursionError, MemoryError) as exc:
        raise UndecodableMessage(f"not JSON: {type(exc).__name__}: {exc}"[:300]) from None


def _load(data: Any, max_bytes: int, content_type: str) -> Any:
    if content_type == MSGPACK:
        return _unpack(data, max_bytes)
    if content_type == JSON:
        return _parse_json(data, max_bytes)
    raise UndecodableMessage(
        f"unsupported content-type {content_type!r:.80}: {MSGPACK} (the default) or {JSON}"
    )


def content_type_of(headers: list | None) -> str:
    """The media type a record's (last) `content-type` header names, lower case, parameters
    (`; charset=utf-8`) dropped; MSGPACK when there is none. An unknown one is returned as is:
    decode_request dead-letters it."""
    for key, value in reversed(headers or ()):
        if isinstance(key, str) and key.lower() == CONTENT_TYPE_HEADER:
            text = bytes(value or b"").decode("utf-8", "replace")
            return text.split(";", 1)[0].strip().lower()
    return MSGPACK


def content_headers(content_type: str) -> list[tuple[str, bytes]]:
    """The headers of a record (a request, an event) encoded as `content_type`."""
    return [(CONTENT_TYPE_HEADER, content_type.encode())]


def sniff(data: Any) -> str:
    """JSON when the bytes start (after blanks) with `{`, else MSGPACK: a msgpack map never starts
    with that byte (0x7b is a positive fixint), so a reader needs no header to tell events apart."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return MSGPACK  # not bytes at all: the msgpack path says so
    return JSON if bytes(data[:64]).lstrip()[:1] == b"{" else MSGPACK


def _error_location(loc: tuple) -> str:
    # A location may hold a producer-chosen map key: bounded, valid UTF-8.
    path = ".".join(str(part) for part in loc)
    return path.encode("utf-8", "backslashreplace").decode("utf-8")[:200]


def _first_error(exc: ValidationError) -> tuple[tuple, str]:
    """(location, message) of the first error, without the input (it could be megabytes)."""
    err = exc.errors(include_url=False, include_input=False, include_context=False)[0]
    return err["loc"], err["msg"].removeprefix("Value error, ")


def _check_routing(obj: dict) -> tuple[str, str, int | None]:
    request_id, reply_topic = obj.get("id"), obj.get("reply_topic")
    if not is_legal_id(request_id):
        raise UndecodableMessage("no usable id (1-128 characters of [A-Za-z0-9._:-])")
    if not is_legal_topic(reply_topic):
        raise UndecodableMessage("no usable reply_topic (a legal Kafka topic name)")
    partition = obj.get("reply_partition")
    partition = (
        partition if type(partition) is int and 0 <= partition <= MAX_REPLY_PARTITION else None
    )
    return request_id, reply_topic, partition


def _precheck(obj: dict, max_prompt_tokens: int | None) -> tuple[str, str, str] | None:
    """Rules checked on the raw map before pydantic: (field, message, code) of the first broken."""
    v = obj.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:
        return (
            "v",
            f"v: unsupported protocol version {v!r:.20} (this build speaks {PROTOCOL_VERSION})",
            "invalid_request",
        )
    problem = prompt_fields_problem([f for f in PROMPT_FIELDS if obj.get(f) is not None])
    if problem:
        return problem[0], f"{problem[0]}: {problem[1]}", "invalid_request"
    return _prompt_too_long(obj, max_prompt_tokens) or _over_count_cap(obj)


def _prompt_too_long(obj: dict, max_prompt_tokens: int | None) -> tuple[str, str, str] | None:
    # Cheap: a len() before pydantic walks a million-element list.
    limit = (
        MAX_PROMPT_TOKEN_IDS
        if max_prompt_tokens is None
        else min(max_prompt_tokens, MAX_PROMPT_TOKEN_IDS)
    )
    ids = obj.get("prompt_token_ids")
    if isinstance(ids, list) and len(ids) > limit:
        return (
            "prompt_token_ids",
            f"prompt_token_ids: {len(ids)} tokens, at most {limit} allowed",
            "prompt_too_long",
        )
    messages = obj.get("messages")
    # Every chat message costs at least one token.
    if (
        max_prompt_tokens is not None
        and isinstance(messages, list)
        and len(messages) > max_prompt_tokens
    ):
        return (
            "messages",
            f"messages: {len(messages)} messages cannot fit in {max_prompt_tokens} tokens",
            "prompt_too_long",
        )
    return None


# (field, cap, unit): a len() before pydantic validates each element.
_COUNT_CAPS = (
    ("messages", MAX_MESSAGES, "messages"),
    ("stop", MAX_STOP, "strings"),
    ("stop_token_ids", MAX_STOP_TOKEN_IDS, "ids"),
    ("metadata", MAX_METADATA_KEYS, "keys"),
    ("logit_bias", MAX_LOGIT_BIAS, "entries"),
)


def _over_count_cap(obj: dict) -> tuple[str, str, str] | None:
    for field, cap, unit in _COUNT_CAPS:
        value = obj.get(field)
        if isinstance(value, (list, dict)) and len(value) > cap:
            return field, f"{field}: {len(value)} {unit}, at most {cap} allowed", "invalid_request"
    return None


def decode_request(
    data: bytes,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_prompt_tokens: int | None = None,
    content_type: str = MSGPACK,
) -> Request:
    """Decode and validate one request message, encoded as `content_type` says (MSGPACK or JSON:
    the same schema and caps; see content_type_of). The request remembers it (its events').

    Raises only UndecodableMessage (dead-letter it: an unknown content type too) or
    InvalidRequest (reply ``rejected``, in the request's encoding). ``max_prompt_tokens`` rejects
    longer ``prompt_token_ids`` as ``prompt_too_long``."""
    obj = _load(data, max_bytes, content_type)
    if not isinstance(obj, dict):
        kind = "JSON" if content_type == JSON else "msgpack"
        raise UndecodableMessage(f"not a map: a {kind} {type(obj).__name__}")
    request_id, reply_topic, partition = _check_routing(obj)
    route = dict(request_id=request_id, reply_topic=reply_topic, reply_partition=partition)
    route["content_type"] = content_type
    broken = _precheck(obj, max_prompt_tokens)
    if broken:
        raise InvalidRequest(broken[0], broken[1], code=broken[2], **route)
    # Only str keys name fields; others are unknown (ignored) fields.
    fields = {k: v for k, v in obj.items() if type(k) is str}
    try:
        req = Request.model_validate(fields)
        req._content_type = content_type
        return req
    except ValidationError as exc:
        loc, msg = _first_error(exc)
        path = _error_location(loc) or "request"
        field = str(loc[0]) if loc else "request"
        raise InvalidRequest(field, f"{path}: {msg}", path=path, **route) from None


def _pack(model: BaseModel, exclude_none: bool) -> bytes:
    return msgpack.packb(
        model.model_dump(mode="python", exclude_none=exclude_none), use_bin_type=True
    )


def _encode(model: BaseModel, exclude_none: bool, content_type: str) -> bytes:
    if content_type == MSGPACK:
        return _pack(model, exclude_none)
    if content_type == JSON:
        return model.model_dump_json(exclude_none=exclude_none).encode()
    raise ValueError(f"unsupported content type {content_type!r}")


def encode_request(req: Request, content_type: str = MSGPACK) -> bytes:
    """Request -> msgpack map (or JSON object); None fields are omitted."""
    return _encode(req, True, content_type)


def encode_event(ev: StartedEvent | TokensEvent | DoneEvent, content_type: str = MSGPACK) -> bytes:
    """Event -> msgpack map (or JSON object); optional fields are written as nil, never omitted."""
    return _encode(ev, False, content_type)


def transcode_event(data: bytes, content_type: str, to: str) -> bytes:
    """An encoded event in another encoding (`data` itself when it is the same)."""
    if content_type == to:
        return data
    return encode_event(decode_event(data, len(data), content_type), to)


def decode_event(
    data: bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, content_type: str | None = None
) -> StartedEvent | TokensEvent | DoneEvent:
    """Decode one reply-topic event, msgpack or JSON (by `content_type`, else by its first byte:
    see sniff); UndecodableMessage on anything that is not a v1 event."""
    obj = _load(data, max_bytes, content_type or sniff(data))
    try:
        return _EVENT.validate_python(obj)
    except ValidationError as exc:
        loc, msg = _first_error(exc)
        raise UndecodableMessage(f"not a v1 event: {_error_location(loc)}: {msg}") from None


def encode_cancel(c: Cancel, content_type: str = MSGPACK) -> bytes:
    """Cancel -> msgpack map (or JSON object) ``{"v": 1, "id": ...}``."""
    return _encode(c, True, content_type)


def decode_cancel(data: bytes, max_bytes: int = 64 * 1024) -> Cancel:
    """Decode one cancel-topic message, msgpack or JSON (told apart by the first byte, as
    decode_event's); UndecodableMessage on anything else."""
    obj = _load(data, max_bytes, sniff(data))
    if not isinstance(obj, dict):
        raise UndecodableMessage("not a map")
    try:
        return Cancel.model_validate({k: v for k, v in obj.items() if type(k) is str})
    except ValidationError as exc:
        loc, msg = _first_error(exc)
        raise UndecodableMessage(f"not a v1 cancel: {_error_location(loc)}: {msg}") from None


__all__ = [
    "PROTOCOL_VERSION",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MAX_METADATA_BYTES",
    "MAX_METADATA_KEYS",
    "MAX_STOP",
    "MAX_STOP_LEN",
    "MAX_STOP_TOKEN_IDS",
    "MAX_PROMPT_TOKEN_IDS",
    "MAX_MESSAGES",
    "MAX_ROLE_LEN",
    "MAX_TOKEN_ID",
    "SEED_RANGE",
    "PRIORITY_RANGE",
    "MAX_TIMEOUT_S",
    "MAX_REPLY_PARTITION",
    "MAX_TENANT_LEN",
    "FinishReason",
    "ErrorCode",
    "FINISH_REASONS",
    "ERROR_CODES",
    "EVENT_TYPES",
    "MAX_GRAMMAR_BYTES",
    "MAX_SCHEMA_DEPTH",
    "MAX_CHOICES",
    "MAX_CHOICE_LEN",
    "MAX_TOP_LOGPROBS",
    "MAX_LOGIT_BIAS",
    "LOGIT_BIAS_RANGE",
    "ChatMessage",
    "JsonSchemaFormat",
    "ResponseFormat",
    "StructuredOutputs",
    "Request",
    "Cancel",
    "TopLogprob",
    "TokenLogprob",
    "Usage",
    "Timing",
    "ErrorInfo",
    "StartedEvent",
    "TokensEvent",
    "DoneEvent",
    "Event",
    "UndecodableMessage",
    "InvalidRequest",
    "MSGPACK",
    "JSON",
    "CONTENT_TYPES",
    "CONTENT_TYPE_HEADER",
    "content_type_of",
    "content_headers",
    "sniff",
    "transcode_event",
    "decode_request",
    "encode_request",
    "encode_event",
    "decode_event",
    "encode_cancel",
    "decode_cancel",
    "is_legal_id",
    "is_legal_topic",
    "metadata_bytes",
]
