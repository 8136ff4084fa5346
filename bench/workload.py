"""Deterministic benchmark workloads: chat prompts of varied length, seeded output lengths,
arrivals all at once or as a Poisson process.

Prompts are built from fixed lists (instructions x topics, padded with context sentences), so a
workload depends only on its arguments and the tokenizer: the same seed gives the same prompts,
the same output lengths and the same arrival times in every run.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

INSTRUCTIONS = (
    "Explain in simple words how",
    "Write a short essay on how",
    "Give three practical tips about how",
    "Summarize the main ideas behind how",
    "Describe step by step how",
    "List the common mistakes people make about how",
    "Compare two different views on how",
    "Write a friendly letter to a student about how",
)

TOPICS = (
    "photosynthesis turns sunlight into sugar",
    "a compiler turns source code into machine code",
    "the Roman Empire managed its roads",
    "bees find flowers and share the location",
    "interest rates affect the housing market",
    "a bicycle stays upright while moving",
    "vaccines train the immune system",
    "a database index speeds up queries",
    "glaciers shape mountain valleys",
    "jazz musicians improvise together",
    "a sourdough starter makes bread rise",
    "satellites keep their orbit around the Earth",
    "a city plans its public transport",
    "the heart pumps blood through the body",
    "a chess engine chooses its next move",
    "rivers carry sediment to the sea",
)

CONTEXT = (
    "Assume the reader is curious but has no background in the subject.",
    "Use one concrete example from everyday life to make the idea clear.",
    "Mention what scientists or experts still disagree about, if anything.",
    "Keep the tone warm and avoid jargon unless you define it first.",
    "It helps to start from a question that a child might ask.",
    "Point out one surprising fact that most people do not know.",
    "If numbers matter, give rough orders of magnitude rather than exact figures.",
    "Explain why the topic matters for someone living in a large city today.",
    "Note how the idea was first discovered or invented, and by whom.",
    "Close with a short summary the reader could repeat to a friend.",
    "Avoid lists longer than five items; prefer short paragraphs.",
    "Relate the topic to something the reader may have seen on the news.",
)


@dataclass(frozen=True)
class WorkItem:
    request_id: str
    messages: list[dict[str, str]]
    prompt_token_ids: list[int]  # the chat template applied, as the engine will tokenize it
    max_tokens: int  # the exact output length (ignore_eos)
    arrival_s: float  # offset from the start of the run


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    enc = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(enc["input_ids"])


def make_content(tokenizer, rng: random.Random, num_tokens: int) -> str:
    """A user message of about `num_tokens` tokens (before the chat template)."""
    text = f"{rng.choice(INSTRUCTIONS)} {rng.choice(TOPICS)}."
    context = list(CONTEXT)
    rng.shuffle(context)
    i = 0
    while len(tokenizer(text)["input_ids"]) < num_tokens:
        text += " " + context[i % len(context)]
        i += 1
    ids = tokenizer(text)["input_ids"][:num_tokens]
    return tokenizer.decode(ids).strip()


def make_workload(
    tokenizer,
    num_requests: int = 64,
    min_output: int = 8,
    max_output: int = 256,
    min_prompt: int = 10,
    max_prompt: int = 270,
    seed: int = 0,
) -> list[WorkItem]:
    """`num_requests` requests, all at t=0; user messages of min_prompt..max_prompt tokens (the
    chat template adds ~31), output lengths uniform in [min_output, max_output]."""
    rng = random.Random(seed)
    items = []
    for i in range(num_requests):
        content = make_content(tokenizer, rng, rng.randint(min_prompt, max_prompt))
        messages = [{"role": "user", "content": content}]
        max_tokens = rng.randint(min(min_output, max_output), max_output)
        ids = chat_ids(tokenizer, messages)
        items.append(WorkItem(f"req-{i:04d}", messages, ids, max_tokens, 0.0))
    return items


def from_args(tokenizer, args) -> list[WorkItem]:
    """make_workload with the options of add_workload_args (and --seed)."""
    return make_workload(
        tokenizer,
        args.num_requests,
        max_output=args.max_output,
        max_prompt=args.max_prompt,
        seed=args.seed,
    )


def describe(items: list[WorkItem]) -> dict:
    prompts, outs = [len(i.prompt_token_ids) for i in items], [i.max_tokens for i in items]
    return {
        "num_requests": len(items),
        "prompt_tokens": [min(prompts), max(prompts)],
        "output_tokens": [min(outs), max(outs)],
        "total_output": sum(outs),
    }


def line(w: dict) -> str:
    """describe()'s figures in words."""
    return (
        f"{w['num_requests']} requests, prompts {w['prompt_tokens']} tokens, outputs "
        f"{w['output_tokens']} (total {w['total_output']})"
    )


def with_arrivals(items: list[WorkItem], rate: float | None, seed: int = 0) -> list[WorkItem]:
    """The same requests with new arrival times (Poisson at `rate`, or all at 0)."""
    rng = random.Random(seed + 1)
    out, t = [], 0.0
    for i, item in enumerate(items):
        if rate:
            t += rng.expovariate(rate) if i else 0.0
        out.append(dataclasses.replace(item, arrival_s=t))
    return out


def add_workload_args(parser, **defaults) -> None:
    """The workload's and the engine's options, the same in every benchmark that runs them;
    `defaults`: this benchmark's own. parse() applies --quick."""
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-output", type=int, default=256, help="outputs in [8, this]")
    parser.add_argument("--max-prompt", type=int, default=270, help="user message tokens")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="4 requests x 8 tokens, short prompts")
    parser.set_defaults(**defaults)


def parse(parser, argv):
    """The arguments, --quick shrinking the workload to a smoke run."""
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.max_output = min(args.num_requests, 4), min(args.max_output, 8)
        args.max_prompt = 40
    return args
