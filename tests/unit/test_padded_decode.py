"""Decode steps padded to a bucket on static buffers (worker/engine/padded_decode.py), the step a
CUDA graph captures, run eagerly on the CPU with the kernels `auto` picks here (the C attention
and fused ops); and the capture code (worker/engine/cuda_graphs.py) with a fake capture, since
torch.cuda.CUDAGraph needs CUDA. The Triton kernels run the same step under the interpreter in
tests/kernels/test_padded_decode_triton.py."""

from __future__ import annotations

import pytest
import torch

from inferline.config.settings import Settings, SettingsError, load_settings
from inferline.kernels.attention import TorchAttention
from inferline.kernels.backends import BackendUnavailable
from tests.engine_fixtures import make_engine, run_to_completion
from tests.unit.test_engine import request
from inferline.worker.engine.cuda_graphs import DecodeGraphs
from inferline.worker.engine.device import pick_cuda_graphs
from inferline.worker.engine.model_runner import ModelRunner
from inferline.worker.engine.padded_decode import PaddedDecode, bucket_for, capture_sizes
from inferline.worker.engine.request import SamplingParams
from inferline.worker.engine.scheduler import ScheduledSequence
from inferline.worker.engine.sequence import Sequence


def test_capture_sizes_and_the_bucket_of_a_batch():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert (
        capture_sizes(8) == [1, 2, 4, 8]
        and capture_sizes(3) == [1, 2, 3]
        and capture_sizes(1) == [1]
    )
    sizes = capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 63, 64, 65)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        24,
        64,
        64,
        None,
    ]


def test_only_decode_only_steps_take_a_bucket(eager_runner):
    padded = eager_runner.padded_decode
    seq = Sequence("s", [1, 2, 3], SamplingParams())
    assert padded.bucket([ScheduledSequence(seq, 1)] * 3) == 4
    assert (
        padded.bucket([ScheduledSequence(seq, 1), ScheduledSequence(seq, 2)]) is None
    )  # a prompt chunk
    assert padded.bucket([ScheduledSequence(seq, 3, [7, 8])]) is None  # drafts
    assert padded.bucket([ScheduledSequence(seq, 1)] * 65) is None  # above the largest bucket
    assert padded.bucket([]) is None


def test_the_cuda_graphs_setting(monkeypatch):
    assert Settings().model.cuda_graphs == "auto"
    monkeypatch.setenv("INFERLINE_MODEL__CUDA_GRAPHS", "eager")
    assert load_settings().model.cuda_graphs == "eager"
    monkeypatch.setenv("INFERLINE_MODEL__CUDA_GRAPHS", "sometimes")
    with pytest.raises(SettingsError, match="INFERLINE_MODEL__CUDA_GRAPHS"):
        load_settings()
    assert pick_cuda_graphs("auto", "cuda", "triton") == "capture"
    assert pick_cuda_graphs("on", "cuda", "triton") == "capture"
    for device, attention in (("cpu", "cpu"), ("cpu", "triton"), ("cuda", "torch")):
        assert pick_cuda_graphs("auto", device, attention) == "off"
        with pytest.raises(BackendUnavailable, match="INFERLINE_MODEL__CUDA_GRAPHS=eager"):
            pick_cuda_graphs("on", device, attention)
    for device, attention in (("cpu", "cpu"), ("cuda", "triton"), ("cpu", "torch")):
        assert pick_cuda_graphs("eager", device, attention) == "eager"
        assert pick_cuda_graphs("off", device, attention) == "off"


def test_cuda_graphs_on_without_cuda_stops_the_runner_at_start_up():
    settings = Settings()
    settings.model.cuda_graphs = "on"
    settings.cache.num_blocks = 4
    with pytest.raises(BackendUnavailable, match="cuda_graphs=on captures on CUDA"):
        ModelRunner(settings)


@pytest.fixture(scope="module")
def eager_runner() -> ModelRunner:
    settings = Settings()
    settings.model.cuda_graphs = "eager"
    settings.cache.num_blocks = 64
    return ModelRunner(settings)


class Recorder:
    """Wraps a method; records (rows of the padded step, real rows) per call of
    PaddedDecode.load."""

    def __init__(self, padded: PaddedDecode):
        self.padded, self.load, self.steps = padded, padded.load, []

    def __enter__(self):
        def load(step):
            self.steps.append((step.tokens.shape[1], len(step.ordered)))
            return self.load(step)

        self.padded.load = load
        return self

    def __exit__(self, *exc):
        del self.padded.load


def test_padded_decode_steps_equal_hf_generate(eager_runner, prompts, hf_outputs):
    """Five sequences finishing one after another: decode batches of 5, 4, 3, 2, 1 rows, run as
    buckets 8, 4, 4, 2, 1 (5 and 3 are not buckets), on the C kernels `auto` picks on the CPU."""
    assert eager_runner.cuda_graphs == "eager" and eager_runner.decode_graphs is None
    assert eager_runner.backends.attention in ("cpu", "torch")  # cpu wherever the C kernels build
    lengths = [24, 20, 16, 12, 8]
    with Recorder(eager_runner.padded_decode) as rec:
        results = run_to_completion(
            make_engine(eager_runner),
            {0: [request(i, prompts[i], n) for i, n in enumerate(lengths)]},
        )
    for i, n in enumerate(lengths):
        assert results[f"r{i}"]["tokens"] == hf_outputs[i][:n], (
            f"prompt {i} diverged from HF generate"
        )
    assert {(5, 8), (4, 4), (3, 4), (2, 2), (1, 1)} <= {(n, rows) for rows, n in rec.steps}


def decode_batch(runner: ModelRunner, num_seqs: int) -> list[ScheduledSequence]:
    """num_seqs sequences decoding their next token, contexts of 20 + 13 i tokens on their own
    blocks (the K/V there: whatever the cache holds)."""
    out, block, bs = [], 1, runner.block_size
    for i in range(num_seqs):
        n = 20 + 13 * i
        seq = Sequence(
            f"s{i}", [(5 * t + i) % 1000 + 3 for t in range(n)], SamplingParams(max_tokens=8)
        )
        seq.num_computed_tokens = n - 1
        seq.block_table = list(range(block, block + -(-n // bs)))
        block += len(seq.block_table)
        out.append(ScheduledSequence(seq, 1))
    return out


def fill_cache(runner: ModelRunner, batch: list[ScheduledSequence]) -> None:
    """Random K/V in the batch's context slots, NaN in every other slot: a row that read a slot it
    should not would give NaN."""
    gen = torch.Generator().manual_seed(0)
    for k, v in runner.kv_cache:
        for cache in (k, v):
            cache.fill_(float("nan"))
            flat = cache.view(-1, *cache.shape[2:])
            for s in batch:
                table, n = s.seq.block_table, s.seq.num_tokens
                slots = torch.tensor(
                    [
                        table[p // runner.block_size] * runner.block_size + p % runner.block_size
                        for p in range(n)
                    ]
                )
                flat[slots] = torch.randn(n, *cache.shape[2:], generator=gen).to(cache.dtype)


def flat_logits(runner: ModelRunner, batch: list[ScheduledSequence]) -> torch.Tensor:
    step = runner.step_builder.build(batch)
    meta = runner.attention.prepare(step.tables, fused_ops=runner.backends.fused_ops)
    hidden = runner.model(step.input_ids, step.tables.positions, runner.kv_cache, meta)
    return runner.model.compute_logits(hidden[step.logits_indices])


def real_slots(runner: ModelRunner, batch: list[ScheduledSequence]) -> set[int]:
    bs = runner.block_size
    return {
        s.seq.block_table[p // bs] * bs + p % bs for s in batch for p in [s.seq.num_computed_tokens]
    }


@pytest.mark.parametrize("attention", ["auto", "torch"])
def test_padding_rows_write_no_kv_and_read_none(eager_runner, attention):
    """3 decodes in bucket 4, after a step of 8 rows left its entries in the buffers: the cache is
    bit-identical outside the 3 rows' slots, every logit is finite (no padding row read a NaN
    slot), and the real rows' logits are the flat step's (the same bits on the C kernels)."""
    runner, padded = eager_runner, eager_runner.padded_decode
    if attention == "torch":
        padded = PaddedDecode(
            runner.model,
            runner.kv_cache,
            TorchAttention(runner.block_size, runner.config.num_key_value_heads),
            runner.backends.fused_ops,
            padded.sizes,
            padded.buffers.block_tables.shape[1],
            runner.config.vocab_size,
            runner.dtype,
            runner.device,
        )
    saved = [(k.clone(), v.clone()) for k, v in runner.kv_cache]
    try:
        with torch.inference_mode():
            wide = decode_batch(runner, 8)
            padded.load(runner.step_builder.build_decode(wide, 8))  # stale entries in rows 3..7
            batch = decode_batch(runner, 3)
            fill_cache(runner, batch)
            before = [(k.clone(), v.clone()) for k, v in runner.kv_cache]
            padded.load(runner.step_builder.build_decode(batch, 4))
            logits = padded.forward(4)
            assert torch.isfinite(logits).all()
            changed = set()
            for (k, v), (k0, v0) in zip(runner.kv_cache, before):
                for now, was in ((k, k0), (v, v0)):
                    diff = ~((now == was) | (now.isnan() & was.isnan()))
                    changed |= set(
                        diff.view(-1, diff[0, 0].numel()).any(1).nonzero().flatten().tolist()
                    )
            assert changed == real_slots(runner, batch)
            if (
                attention == "auto"
            ):  # the flat step over the same cache (it stores the same K/V again)
                assert torch.equal(logits[:3], flat_logits(runner, batch))
    finally:
        for (k, v), (k0, v0) in zip(runner.kv_cache, saved):
            k.copy_(k0)
            v.copy_(v0)


def test_the_static_buffers_are_the_step_inputs_every_step(eager_runner, prompts):
    """Every decode step's model inputs are views of the same persistent tensors (what a graph
    replays reads), and its logits the same buffer."""
    buffers, seen = eager_runner.padded_decode.buffers, []
    model_forward = eager_runner.model.forward

    def forward(input_ids, positions, kv_cache, meta):
        if meta.num_decode_tokens == input_ids.shape[0]:
            seen.append(
                (
                    input_ids.data_ptr(),
                    positions.data_ptr(),
                    meta.slot_mapping.data_ptr(),
                    meta.context_lens.data_ptr(),
                    meta.block_tables.data_ptr(),
                )
            )
        return model_forward(input_ids, positions, kv_cache, meta)

    eager_runner.model.forward = forward
    try:
        run_to_completion(
            make_engine(eager_runner), {0: [request(i, prompts[i], 6) for i in range(3)]}
        )
    finally:
        del eager_runner.model.forward
    tokens = buffers.tokens
    expected = (
        tokens[0].data_ptr(),
        tokens[1].data_ptr(),
        tokens[2].data_ptr(),
        buffers.context_lens.data_ptr(),
        buffers.block_tables.data_ptr(),
    )
    assert len(seen) >= 5 and set(seen) == {expected}
    logits_ptrs = {eager_runner.padded_decode.forward(b).data_ptr() for b in (1, 4)}
    assert logits_ptrs == {buffers.logits.data_ptr()}


class FakeGraph:
    """What cuda_capture returns, without CUDA: replay() runs the captured step eagerly."""

    def __init__(self, step, pool, calls: list):
        self.step, self.given_pool, self.calls = step, pool, calls

    def replay(self):
        self.calls.append("replay")
        self.step()

    def pool(self):
        return ("pool", id(self.calls))


def test_decode_graphs_capture_each_bucket_and_replay_them(eager_runner, prompts, hf_outputs):
    """The capture runner, largest bucket first, one eager forward before each capture, every graph
    in the first one's pool, no K/V written; an engine then decodes through replay() and gives
    HF's tokens. Only the capture itself (torch.cuda.graph) is faked."""
    runner, calls, pools = eager_runner, [], []
    runner_padded = runner.padded_decode
    # buckets up to 8 (the runner's go to 64): the capture's eager forwards on the CPU stay short
    padded = PaddedDecode(
        runner.model,
        runner.kv_cache,
        runner.attention,
        runner.backends.fused_ops,
        capture_sizes(8),
        runner.padded_decode.buffers.block_tables.shape[1],
        runner.config.vocab_size,
        runner.dtype,
        runner.device,
    )
    forward = padded.forward

    def traced(bucket):
        calls.append(bucket)
        return forward(bucket)

    def capture(step, pool):
        calls.append("capture")
        pools.append(pool)
        step()  # what torch.cuda.graph records: the step run once, on padding rows
        return FakeGraph(step, pool, calls)

    padded.forward = traced
    before = [(k.clone(), v.clone()) for k, v in runner.kv_cache]
    try:
        graphs = DecodeGraphs(padded, capture)
        report = graphs.capture_all()
        assert (
            report.buckets
            == sorted(padded.sizes, reverse=True)
            == sorted(graphs.graphs, reverse=True)
        )
        assert calls == [x for b in report.buckets for x in (b, "capture", b)]
        assert pools == [None] + [("pool", id(calls))] * (len(report.buckets) - 1)
        assert all(
            torch.equal(k, k0) and torch.equal(v, v0)
            for (k, v), (k0, v0) in zip(runner.kv_cache, before)
        )
        calls.clear()
        runner.padded_decode, runner.decode_graphs = padded, graphs
        lengths = [10, 7, 4]
        results = run_to_completion(
            make_engine(runner), {0: [request(i, prompts[i], n) for i, n in enumerate(lengths)]}
        )
    finally:
        runner.padded_decode, runner.decode_graphs = runner_padded, None
    for i, n in enumerate(lengths):
        assert results[f"r{i}"]["tokens"] == hf_outputs[i][:n]
    assert calls.count("replay") >= 9 and {4, 2, 1} <= {c for c in calls if c != "replay"}
