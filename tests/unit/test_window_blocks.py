"""The paged KV cache frees blocks wholly behind the sliding window when every layer has one
(issue 54 item 3): a tiny random-weight Mistral (window 16, 8-token blocks) generates far past
its window on the C and PyTorch attention; the tokens stay transformers' while other sequences
reuse the freed blocks, a sequence never holds more than the window's blocks, and the
KV-usage metric falls when they go."""

from __future__ import annotations

import json

import pytest
import torch

from inferline.config.settings import Settings
from inferline.worker.engine.block_manager import NULL_BLOCK, BlockManager, sliding_window
from inferline.worker.engine.model_runner import ModelRunner
from inferline.worker.engine.models.loader import synthetic_tokenizer
from inferline.worker.engine.request import EngineRequest
from inferline.worker.engine.request import SamplingParams
from inferline.worker.engine.sequence import Sequence
from tests.engine_fixtures import BlockWatch, greedy, make_engine, run_to_completion
from tests.unit.test_window_rope import SHAPE, saved_with_greedy

WINDOW, BLOCK = 16, 8
# Blocks a decoding sequence holds: those a window of WINDOW tokens touches.
BOUND = -(-WINDOW // BLOCK) + 1
NEW_TOKENS = 24
PROMPT_LENS = (37, 29, 19)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """(model directory, prompts, HF greedy outputs) of a Mistral windowed on every layer."""
    from transformers import MistralConfig

    config = MistralConfig(
        **{**SHAPE, "num_hidden_layers": 2}, sliding_window=WINDOW, max_position_embeddings=256
    )
    folder = tmp_path_factory.mktemp("mistral-window-blocks")
    _, prompts, expected = saved_with_greedy(config, folder, 2, PROMPT_LENS, NEW_TOKENS)
    return folder, prompts, expected


@pytest.fixture(scope="module")
def runner_for(windowed):
    """runner_for(attention): one runner per attention backend for the module."""
    runners: dict[str, ModelRunner] = {}

    def make(attention: str) -> ModelRunner:
        if attention not in runners:
            runners[attention] = load_runner(windowed[0], attention)
        return runners[attention]

    return make


def load_runner(folder, attention: str) -> ModelRunner:
    settings = Settings()
    settings.model.path = str(folder)
    settings.model.max_model_len = 128
    settings.model.attention_backend = attention
    settings.model.cpu_linear = "c"  # no timing of the candidates at load
    settings.cache.block_size = BLOCK
    settings.cache.kv_memory_gb = 0.01
    return ModelRunner(settings)


def request(rid: str, ids: list[int], priority: int = 0) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=ids,
        sampling=greedy(NEW_TOKENS, ignore_eos=True),
        priority=priority,
    )


# make test runs the C attention; make test-full the PyTorch reference too (the suite's budget).
@pytest.mark.parametrize("attention", ["cpu", pytest.param("torch", marks=pytest.mark.full)])
def test_freed_blocks_are_reused_and_tokens_stay_transformers(windowed, runner_for, attention):
    """10 blocks (a request must fit the pool whole: a recompute reserves its whole context):
    the 37- and 29-token prompts take 9, and their next blocks are the ones they freed behind
    their windows; at step 3 two better-priority requests need 8 and preempt (recompute).
    Without the freeing, the 8 + 7 blocks each holds at its end would not fit together: no
    block would be reused while its first owner runs."""
    folder, prompts, expected = windowed
    runner = runner_for(attention)
    assert runner.model.windows == [WINDOW, WINDOW]
    engine = make_engine(runner, num_blocks=10, enable_prefix_caching=False)
    assert engine.block_manager.window == WINDOW
    watch = BlockWatch()
    arrivals = {
        0: [request("r0", prompts[0], 1), request("r1", prompts[1], 1)],
        3: [request("r2", prompts[2], 0), request("r3", prompts[0], 0)],
    }
    results = run_to_completion(engine, arrivals, on_step=watch)
    for i, want in enumerate([*expected, expected[0]]):
        assert results[f"r{i}"]["tokens"] == want, f"r{i} diverged from HF generate"
    assert watch.max_decode_blocks <= BOUND, watch.max_decode_blocks
    assert watch.num_reused > 0, "no sequence took a block another running one had freed"
    assert engine.stats().num_preemptions >= 1, "the case should exercise a recompute"


def test_kv_usage_falls_as_blocks_free(windowed, runner_for):
    """One 37-token prompt: 5 blocks after its prefill, BOUND or fewer from the first decode on
    (the metric counts held blocks only), none when it ends."""
    folder, prompts, expected = windowed
    engine = make_engine(runner_for("cpu"), num_blocks=32, enable_prefix_caching=False)
    watch = BlockWatch()
    results = run_to_completion(engine, {0: [request("r0", prompts[0])]}, on_step=watch)
    assert results["r0"]["tokens"] == expected[0]
    held = [round(u * 32) for u in watch.usage]
    assert held[0] == -(-PROMPT_LENS[0] // BLOCK), held
    assert held[1] < held[0] and max(held[1:]) <= BOUND, held
    assert engine.block_manager.usage == 0.0


# ---- the block manager alone ---------------------------------------------------------------------


def seq_of(n: int, rid: str = "s") -> Sequence:
    return Sequence(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=100))


def test_only_blocks_before_the_next_querys_window_are_freed():
    """Window 16, blocks of 4: the query at position p sees keys > p - 16, so after p tokens
    the blocks wholly at or before p - 16 go, and no other."""
    bm = BlockManager(num_blocks=20, block_size=4, window=16)
    seq = seq_of(30)
    bm.allocate(seq, [])
    for computed, freed in ((15, 0), (18, 0), (19, 1), (22, 1), (23, 2), (26, 2), (27, 3), (30, 3)):
        seq.num_computed_tokens = computed
        bm.free_behind_window(seq)
        assert seq.num_freed_blocks == freed, computed
        assert seq.block_table[:freed] == [NULL_BLOCK] * freed
        assert bm.num_free_blocks == 20 - 8 + freed
        bm.check_integrity([seq])
    bm.free(seq)
    seq.num_computed_tokens = 0  # as a preemption leaves it
    assert bm.num_free_blocks == 20 and seq.num_freed_blocks == 0
    bm.check_integrity([seq])


def test_a_layer_without_a_window_keeps_every_block():
    assert sliding_window([16, 16, 8]) == 16
    assert sliding_window([None, 16]) is None  # a global layer reads every block
    assert sliding_window(None) is None
    bm = BlockManager(num_blocks=20, block_size=4, window=None)
    seq = seq_of(30)
    bm.allocate(seq, [])
    seq.num_computed_tokens = 30
    assert bm.free_behind_window(seq) == 0 and bm.num_free_blocks == 12


def test_a_freed_cached_block_stays_intact_for_a_later_prefix_hit():
    """A block freed behind the window keeps its prefix-cache key on the free list (as a finished
    sequence's): a request with the same prompt shares it; a shared one loses one owner only."""
    bm = BlockManager(num_blocks=20, block_size=4, enable_prefix_caching=True, window=8)
    a, b = seq_of(21, "a"), seq_of(21, "b")
    bm.allocate(a, [])
    a.num_computed_tokens = 21
    bm.cache_computed_blocks(a)
    first_blocks = a.block_table[:2]
    bm.allocate(b, bm.cached_prefix(b))  # b shares a's 5 full blocks
    assert b.block_table[:5] == a.block_table[:5]
    assert bm.free_behind_window(a) == 3  # the query at 21 sees keys > 13: blocks 0-2 go
    assert all(bm.ref_counts[x] == 1 for x in first_blocks), "b still holds them"
    b.num_computed_tokens = 21
    bm.free_behind_window(b)
    assert all(x in bm.free_block_ids for x in first_blocks)
    c = seq_of(21, "c")
    assert bm.cached_prefix(c)[:2] == first_blocks, "freed blocks are still cached"
    bm.check_integrity([a, b])


def test_a_fork_shares_no_block_its_window_needs_but_the_parent_freed():
    bm = BlockManager(num_blocks=20, block_size=4, window=8)
    parent = seq_of(23)
    bm.allocate(parent, [])
    parent.num_computed_tokens = 22
    bm.free_behind_window(parent)  # the query at 22 sees keys > 14: blocks 0-2 go
    assert parent.num_freed_blocks == 3
    child = seq_of(23, "child")
    bm.fork(parent.block_table[:5], child)  # from 20 it reads keys > 12: block 3 only
    assert child.num_freed_blocks == 3 and child.num_computed_tokens == 20
    bm.allocate(child, bm.cached_prefix(child))  # admitted as the scheduler admits a fork
    assert child.num_freed_blocks == 3 and len(child.block_table) == 6
    late = seq_of(23, "late")
    bm.fork(parent.block_table[:4], late)  # from 16 it would read block 2: nothing shared
    assert late.block_table == [] and late.num_computed_tokens == 0
    bm.check_integrity([parent, child, late])


def test_step_rows_zero_the_freed_entries():
    from inferline.worker.engine.step_inputs import BlockTableRows

    bm = BlockManager(num_blocks=20, block_size=4, window=8)
    seq = seq_of(23)
    bm.allocate(seq, [])
    rows = BlockTableRows(max_blocks=8)
    (row,) = rows.assign([seq])
    table = list(seq.block_table)
    seq.num_computed_tokens = 22
    bm.free_behind_window(seq)  # blocks 0-2
    (row,) = rows.assign([seq])
    assert rows.table[row, :6].tolist() == [0, 0, 0] + table[3:], "freed entries read block 0"


TRITON_TOKENS = 10


@pytest.mark.full  # ~30 s on the interpreter (86 s on the loaded 2-core VM): make test-full
def test_triton_kernels_reuse_freed_blocks(windowed):
    """The same freeing through the Triton kernels under the interpreter: two prompts past the
    window in a 10-block pool (9 at admission), their next blocks the ones they freed."""
    from tests.kernels.test_triton_engine import run_cases

    folder, prompts, expected = windowed
    cases = {
        "model": str(folder),
        "block_size": BLOCK,
        "runs": [
            {
                "name": "freeing",
                "scheduler": {"num_blocks": 10, "enable_prefix_caching": False},
                "arrivals": {"0": [[f"r{i}", prompts[i], TRITON_TOKENS] for i in (0, 1)]},
                "watch": True,
            }
        ],
    }
    (run,) = [line for line in run_cases(["smollm2"], json.dumps(cases)) if "run" in line]
    for i in (0, 1):
        assert run["tokens"][f"r{i}"] == expected[i][:TRITON_TOKENS], f"r{i} on Triton diverged"
    assert run["max_decode_blocks"] <= BOUND and run["num_reused"] > 0, run
