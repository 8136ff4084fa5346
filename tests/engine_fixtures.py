"""Shared, expensive engine objects: one loaded model and one HF reference per test session."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from inferline.config.settings import Settings, SpeculativeSettings
from inferline.worker.engine.engine import LLMEngine
from inferline.worker.engine.model_runner import ModelRunner
from inferline.worker.engine.request import EngineRequest, SamplingParams


@pytest.fixture(scope="session")
def model_runner() -> ModelRunner:
    return ModelRunner(Settings())


@pytest.fixture(scope="session")
def hf_model():
    from transformers import AutoModelForCausalLM

    from inferline.worker.engine.models.loader import resolve_model_dir

    return AutoModelForCausalLM.from_pretrained(
        str(resolve_model_dir()), dtype=torch.float32
    ).eval()


SHALLOW_LAYERS = 4


@pytest.fixture(scope="session")
def shallow_smollm2(tmp_path_factory) -> Path:
    """SmolLM2 cut to its first SHALLOW_LAYERS layers, as an HF directory: the Triton interpreter
    runs every kernel program in Python (seconds a layer), and each layer runs the same kernels."""
    from safetensors.torch import load_file, save_file

    from inferline.worker.engine.models.loader import resolve_model_dir

    full, shallow = resolve_model_dir(), tmp_path_factory.mktemp("smollm2-shallow")
    kept = tuple(f"model.layers.{i}." for i in range(SHALLOW_LAYERS))
    state = load_file(str(full / "model.safetensors"))
    save_file(
        {k: v for k, v in state.items() if not k.startswith("model.layers.") or k.startswith(kept)},
        str(shallow / "model.safetensors"),
    )
    config = json.loads((full / "config.json").read_text())
    (shallow / "config.json").write_text(
        json.dumps({**config, "num_hidden_layers": SHALLOW_LAYERS})
    )
    for other in full.iterdir():
        if other.name not in ("model.safetensors", "config.json"):
            shutil.copy(other, shallow / other.name)
    return shallow


@pytest.fixture(scope="session")
def shallow_runner(shallow_smollm2) -> ModelRunner:
    """A runner over shallow_smollm2, for engine tests that are not about the model's depth."""
    settings = Settings()
    settings.model.path = str(shallow_smollm2)
    settings.cache.kv_memory_gb = 0.25
    return ModelRunner(settings)


@pytest.fixture(scope="session")
def shallow_hf_model(shallow_smollm2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(shallow_smollm2), dtype=torch.float32).eval()


NEW_TOKENS = 32  # each prompt's greedy tokens against HF (the suite's budget: 48 took 1.5x)

TOPICS = [
    "Kafka consumer groups",
    "the French revolution",
    "photosynthesis",
    "binary search",
    "the water cycle",
    "black holes",
    "how vaccines work",
    "TCP congestion control",
    "the history of jazz",
    "compound interest",
    "volcanoes",
    "the Rust borrow checker",
    "paged attention in LLM serving",
    "bread baking",
    "the moon landing",
    "sorting algorithms",
]


def prompt_ids(tokenizer, i: int) -> list[int]:
    """Chat prompts of clearly different lengths (one to many sentences of instructions)."""
    detail = " Give concrete examples and explain every step in detail." * (i % 5)
    messages = [
        {"role": "user", "content": f"Write a long, detailed essay about {TOPICS[i]}.{detail}"}
    ]
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )


@pytest.fixture(scope="session")
def prompts(model_runner) -> list[list[int]]:
    return [prompt_ids(model_runner.tokenizer, i) for i in range(len(TOPICS))]


def greedy_outputs(hf_model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS):
    """HF greedy output of each prompt alone, `new_tokens` long (at most: EOS stops it)."""
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = hf_model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


@pytest.fixture(scope="session")
def hf_outputs(hf_model, prompts) -> list[list[int]]:
    return greedy_outputs(hf_model, prompts)


@pytest.fixture(scope="session")
def shallow_hf_outputs(shallow_hf_model, prompts) -> list[list[int]]:
    return greedy_outputs(shallow_hf_model, prompts)


def make_engine(runner: ModelRunner, **scheduler) -> LLMEngine:
    """An engine over the shared runner; `num_blocks=` squeezes the KV pool,
    `enable_prefix_caching=False` turns the prefix cache off, `speculative={...}` sets
    SpeculativeSettings (e.g. {"method": "ngram"})."""
    settings = Settings()
    settings.cache.num_blocks = scheduler.pop("num_blocks", None)
    settings.cache.enable_prefix_caching = scheduler.pop("enable_prefix_caching", True)
    settings.speculative = SpeculativeSettings(**scheduler.pop("speculative", {}))
    for key, value in scheduler.items():
        setattr(settings.scheduler, key, value)
    return LLMEngine(runner, settings)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run_to_completion(
    engine: LLMEngine,
    arrivals: dict[int, list[EngineRequest]] | None = None,
    check: bool = True,
    on_step=None,
) -> dict[str, dict]:
    """Step until idle, adding `arrivals[step]` before each step; returns per-request results:
    token ids, concatenated text deltas and the final output. `on_step(engine)` after each step."""
    arrivals = dict(arrivals or {})
    results: dict[str, dict] = {}
    step = 0
    while arrivals or engine.has_unfinished_requests():
        for req in arrivals.pop(step, []):
            engine.add_request(req)
        for out in engine.step():
            r = results.setdefault(
                out.request_id, {"tokens": [], "text": "", "final": None, "started": 0}
            )
            r["tokens"] += out.new_token_ids
            r["text"] += out.text_delta
            r["started"] += out.started
            if out.finished:
                assert r["final"] is None, f"{out.request_id} finished twice"
                r["final"] = out
        if check:
            engine.check_integrity()
        if on_step is not None:
            on_step(engine)
        step += 1
    return results


class BlockWatch:
    """An on_step for run_to_completion: after each step, the most blocks a decoding sequence
    holds (freed ones not counted), the KV-usage metric, and how often a sequence took a block
    that another one still running held before (freed behind its sliding window)."""

    def __init__(self):
        self.max_decode_blocks = 0
        self.usage: list[float] = []
        self.num_reused = 0
        self.owner: dict[int, str] = {}  # block -> the last sequence seen holding it
        self.computed: dict[str, int] = {}  # sequence -> its computed tokens a step before

    def __call__(self, engine: LLMEngine) -> None:
        running = engine.scheduler.running
        ids = {s.request_id for s in running}
        for seq in running:
            held = seq.block_table[seq.num_freed_blocks :]
            decoded = self.computed.get(seq.request_id) == seq.num_computed_tokens - 1
            if decoded and seq.num_computed_tokens > seq.num_prompt_tokens:
                self.max_decode_blocks = max(self.max_decode_blocks, len(held))
            for block_id in held:
                before = self.owner.get(block_id, seq.request_id)
                self.num_reused += before != seq.request_id and before in ids
                self.owner[block_id] = seq.request_id
        for seq in engine.scheduler.owners():  # a preempted one starts over from 0
            self.computed[seq.request_id] = seq.num_computed_tokens
        self.usage.append(engine.stats().kv_cache_usage)
