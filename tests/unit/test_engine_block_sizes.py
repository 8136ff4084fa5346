"""Greedy output equals HF `generate` at block sizes other than the default 16.

The session's `model_runner` has 16-token blocks; each size here gets a ModelRunner of its own
(INFERLINE_CACHE__BLOCK_SIZE) with a small cache. Prompts arrive staggered under a small token
budget, so prefill is chunked next to running decodes, a repeated prompt starts from cached
blocks (where its blocks are full), and every sequence decodes across block boundaries: a long
prompt makes even 128-token blocks overflow. (The Triton kernels under the interpreter are
checked at 16 only, in tests/kernels/test_triton_engine.py.)
"""

from __future__ import annotations

import pytest
import torch

from inferline.config.settings import Settings
from tests.engine_fixtures import greedy, make_engine
from inferline.worker.engine.model_runner import ModelRunner
from inferline.worker.engine.request import EngineRequest

NEW = 24
CHOSEN = (0, 4)  # prompts of 41 and 81 tokens
LONG_CONTENT = (
    "Write a long, detailed essay about paged attention in LLM serving."
    + " Give concrete examples and explain every step in detail." * 7
)


@pytest.fixture(scope="module", params=[8, 32, 128], ids=lambda bs: f"block{bs}")
def sized_runner(request) -> ModelRunner:
    settings = Settings()
    settings.cache.block_size = request.param
    settings.cache.num_blocks = 4096 // request.param  # the same 4,096 slots at every size
    return ModelRunner(settings)


@pytest.fixture(scope="module")
def long_case(model_runner, hf_model) -> tuple[list[int], list[int]]:
    """A prompt just short of 128 tokens and HF's greedy continuation of it."""
    messages = [{"role": "user", "content": LONG_CONTENT}]
    ids = list(
        model_runner.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )
    assert len(ids) < 128 < len(ids) + NEW
    with torch.inference_mode():
        x = torch.tensor([ids])
        y = hf_model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
        )
    return ids, y[0, len(ids) :].tolist()


def test_greedy_equals_hf_at_this_block_size(sized_runner, prompts, hf_outputs, long_case):
    bs = sized_runner.block_size
    long_ids, long_expected = long_case
    engine = make_engine(sized_runner, max_num_batched_tokens=48, max_num_seqs=8)
    assert engine.block_manager.block_size == bs
    chosen = [(f"r{i}", prompts[i], hf_outputs[i][:NEW]) for i in CHOSEN]
    cases = [*chosen, ("long", long_ids, long_expected), ("again", *chosen[1][1:])]
    arrivals = {
        0: cases[:1],
        2: cases[1:2],
        4: cases[2:3],
        9: cases[3:],
    }  # "again" after r4's prefill
    tokens: dict[str, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for rid, ids, _ in arrivals.get(step, []):
            engine.add_request(
                EngineRequest(request_id=rid, prompt_token_ids=ids, sampling=greedy(NEW))
            )
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.check_integrity()
        assert 0.0 <= engine.stats().kv_cache_waste <= 1.0
        step += 1
    for rid, _, expected in cases:
        assert tokens[rid] == expected, f"{rid} diverged from HF generate at block size {bs}"
    if bs < 128:  # the chat template's system prompt and more fill whole blocks: reused
        assert engine.stats().prefix_cache_hits > 0
