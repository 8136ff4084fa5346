"""Overlapped steps (worker/engine/overlap.py) forced on the CPU: step N+1 is scheduled and
launched before step N's tokens are read back, its decodes taking their input token from N's
sampled ids on the device; greedy output must stay HF `generate`'s, token for token."""

from __future__ import annotations

import pytest

from inferline.config.settings import load_settings
from inferline.worker.engine.overlap import (
    needs_tokens_first,
    pending_rows,
    pick_overlap,
    serial_reason,
)
from inferline.worker.engine.request import EngineRequest, SamplingParams
from inferline.worker.engine.scheduler import ScheduledSequence
from inferline.worker.engine.sequence import PENDING, Sequence
from tests.engine_fixtures import greedy, make_engine


def overlapped(runner, **scheduler):
    engine = make_engine(runner, **scheduler)
    engine.overlap = True  # `auto` is off on the CPU
    return engine


class Watch:
    """Counts the steps left in flight (and whose rows they had) and the input rows gathered on
    the device."""

    def __init__(self, engine):
        self.engine, self.in_flight, self.gathered, self.rows = engine, 0, 0, 0
        self.overlapped: set[str] = set()  # request ids with a row in a step left in flight
        runner, pending = engine.runner, engine.runner._take_pending

        def take_pending(batch, in_flight):
            before = batch.input_ids.clone()
            pending(batch, in_flight)
            self.gathered += int((batch.input_ids != before).sum())
            self.buckets.add(batch.bucket)

        self.buckets: set = set()
        runner._take_pending = take_pending  # an instance attribute over the method

    def close(self):
        del self.engine.runner._take_pending


def drive(engine, arrivals: dict, aborts: dict | None = None) -> tuple[dict, Watch]:
    """Step until idle: `arrivals[step]` added and `aborts[step]` (request ids) aborted before
    each step. Returns {(request id, sample): {tokens, final}} and the Watch."""
    arrivals, aborts, results, step = dict(arrivals), dict(aborts or {}), {}, 0
    watch = Watch(engine)
    try:
        while arrivals or aborts or engine.has_unfinished_requests():
            for req in arrivals.pop(step, []):
                engine.add_request(req)
            for request_id in aborts.pop(step, []):
                engine.abort(request_id)
            for out in engine.step():
                r = results.setdefault((out.request_id, out.index), {"tokens": [], "final": None})
                r["tokens"] += out.new_token_ids
                if out.finished:
                    assert r["final"] is None, f"{out.request_id} finished twice"
                    r["final"] = out
            if engine._in_flight is not None:
                watch.in_flight += 1
                watch.overlapped |= {c.seq.request_id for c in engine._in_flight[0].scheduled}
            engine.check_integrity()
            watch.rows += engine.stats().num_batched_tokens
            step += 1
    finally:
        watch.close()
    return results, watch


def req(i: int, ids: list[int], params: SamplingParams) -> EngineRequest:
    return EngineRequest(request_id=f"r{i}", prompt_token_ids=ids, sampling=params)


def test_the_overlap_setting(monkeypatch):
    assert load_settings().engine.overlap == "auto"
    monkeypatch.setenv("INFERLINE_ENGINE__OVERLAP", "on")
    assert load_settings().engine.overlap == "on"
    assert [pick_overlap("auto", d) for d in ("cuda", "cpu")] == [True, False]
    assert pick_overlap("on", "cpu") and not pick_overlap("off", "cuda")


def test_what_keeps_a_step_serial():
    def reason(speculative=False, **params):
        return serial_reason(Sequence("s", [1, 2], SamplingParams(**params)), speculative)

    assert reason() is None and reason(temperature=0.8, seed=3) is None
    assert reason(logprobs=2) == "logprobs"
    assert reason(repetition_penalty=1.2) == reason(presence_penalty=0.5) == "penalties"
    assert reason(n=2) == "n > 1"
    assert reason(True, temperature=0.0) == "speculative"
    assert reason(True, temperature=0.8) is None  # no drafts for sampled rows


def test_only_decode_rows_take_a_pending_token_on_the_device():
    a, b, c = (Sequence(name, [1, 2, 3], SamplingParams()) for name in "abc")
    for seq, last in ((a, PENDING), (b, 8), (c, PENDING)):
        seq.output_token_ids, seq.num_computed_tokens = [7, last], 4
    decodes = [ScheduledSequence(a, 1), ScheduledSequence(b, 1)]  # b's input is known
    assert pending_rows(decodes, {id(a): 3}) == ([0], [3])
    assert not needs_tokens_first(decodes)
    c.num_computed_tokens = 0  # preempted, recomputed in one chunk that ends with PENDING
    assert needs_tokens_first(decodes + [ScheduledSequence(c, 5)])
    assert not needs_tokens_first([ScheduledSequence(c, 4)])  # a chunk that stops before it


def test_requests_joining_stopping_and_aborted_mid_run_keep_hf_tokens(
    model_runner, prompts, hf_outputs
):
    """Different max_tokens, stop tokens hit at different steps (a wasted row each), an abort
    mid-run and late arrivals, under a small budget (chunked prefill beside decodes)."""
    engine = overlapped(model_runner, max_num_batched_tokens=64)
    stop_at = {1: 3, 4: 6}  # request -> the output index whose token stops it
    params = {i: greedy(6 + 2 * i) for i in range(6)}
    for i, k in stop_at.items():
        params[i] = greedy(16, stop_token_ids=[hf_outputs[i][k]])
    arrivals = {0: [req(i, prompts[i], params[i]) for i in (0, 1, 2)]}
    arrivals[2] = [req(3, prompts[3], params[3])]
    arrivals[5] = [req(i, prompts[i], params[i]) for i in (4, 5)]
    results, watch = drive(engine, arrivals, aborts={6: ["r2"]})
    assert watch.in_flight > 10 and watch.gathered > 10, vars(watch)
    for i in (0, 1, 3, 4, 5):
        want = hf_outputs[i][: stop_at[i] + 1 if i in stop_at else params[i].max_tokens]
        got = results[(f"r{i}", 0)]
        assert got["tokens"] == want, f"r{i} diverged from HF generate"
        assert got["final"].num_output_tokens == len(want)
        assert got["final"].finish_reason == ("stop" if i in stop_at else "length")
    aborted = results[("r2", 0)]
    assert aborted["final"].finish_reason == "cancelled"
    assert aborted["tokens"] == hf_outputs[2][: len(aborted["tokens"])]
    assert aborted["final"].num_output_tokens == len(aborted["tokens"]) < params[2].max_tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_batch_with_requests_that_cannot_overlap_falls_back_and_keeps_tokens(
    model_runner, prompts, hf_outputs
):
    """Logprobs, n > 1 and a penalty keep their steps serial; plain greedy requests beside them
    overlap once they are gone. Greedy tokens are HF's; the penalized ones the serial engine's."""
    penalized = greedy(8, repetition_penalty=1.3)
    serial = drive(make_engine(model_runner), {0: [req(3, prompts[3], penalized)]})[0]
    engine = overlapped(model_runner)
    plain = [req(i, prompts[i], greedy(14)) for i in (0, 1)]
    unsafe = [
        req(2, prompts[2], greedy(5, logprobs=1)),
        req(3, prompts[3], penalized),
        req(4, prompts[4], greedy(4, n=2)),
    ]
    results, watch = drive(engine, {0: plain[:1] + unsafe, 1: plain[1:]})
    assert watch.in_flight and watch.overlapped == {"r0", "r1"}, vars(watch)
    for i, n in ((0, 14), (1, 14), (2, 5), (4, 4)):
        assert results[(f"r{i}", 0)]["tokens"] == hf_outputs[i][:n], f"r{i} diverged from HF"
    assert results[("r4", 1)]["tokens"] == hf_outputs[4][:4]
    assert results[("r3", 0)]["tokens"] == serial[("r3", 0)]["tokens"]


def test_seeded_sampling_overlaps_and_draws_what_the_serial_engine_draws(model_runner, prompts):
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7)
    arrivals = {0: [req(0, prompts[0], params)], 2: [req(1, prompts[1], params)]}
    serial = drive(make_engine(model_runner), arrivals)[0]
    results, watch = drive(overlapped(model_runner), arrivals)
    assert watch.overlapped == {"r0", "r1"}, vars(watch)
    for key in serial:
        assert results[key]["tokens"] == serial[key]["tokens"], key


def test_greedy_requests_stay_serial_under_speculative_decoding(model_runner, prompts, hf_outputs):
    engine = overlapped(model_runner, speculative={"method": "ngram"})
    results, watch = drive(engine, {0: [req(0, prompts[0], greedy(10))]})
    assert watch.in_flight == 0 and results[("r0", 0)]["tokens"] == hf_outputs[0][:10]


def test_a_sequence_its_token_in_flight_ends_by_length_gets_no_more_rows(
    model_runner, prompts, hf_outputs
):
    results, watch = drive(overlapped(model_runner), {0: [req(0, prompts[0], greedy(6))]})
    assert results[("r0", 0)]["tokens"] == hf_outputs[0][:6]
    assert watch.rows == len(prompts[0]) + 5  # the prompt, then a row for each token but the last


def test_preempted_sequences_keep_their_tokens(model_runner, prompts, hf_outputs):
    """7 blocks hold two of the four (41 to 70 tokens of prompt): a sequence that needs a block
    preempts another whose token is still in flight."""
    engine = overlapped(model_runner, num_blocks=7, enable_prefix_caching=False)
    results, watch = drive(engine, {0: [req(i, prompts[i], greedy(10)) for i in range(4)]})
    assert engine.stats().num_preemptions > 0 and watch.gathered > 10, vars(watch)
    for i in range(4):
        assert results[(f"r{i}", 0)]["tokens"] == hf_outputs[i][:10], f"r{i} diverged from HF"


@pytest.fixture
def padded_runner(model_runner):
    """The shared runner with padded decode steps (`cuda_graphs=eager`) for one test."""
    model_runner.padded_decode = model_runner._padded_decode(8)
    yield model_runner
    model_runner.padded_decode = None


def test_padded_decode_steps_overlap_and_keep_hf_tokens(padded_runner, prompts, hf_outputs):
    """Decode-only steps on the static buffers take their input token there, on the device."""
    lengths = [12, 9, 6, 4, 2]
    engine = overlapped(padded_runner, max_num_seqs=8)
    results, watch = drive(
        engine, {0: [req(i, prompts[i], greedy(n)) for i, n in enumerate(lengths)]}
    )
    assert {8, 4, 2, 1} <= watch.buckets and watch.gathered > 10, vars(watch)
    for i, n in enumerate(lengths):
        assert results[(f"r{i}", 0)]["tokens"] == hf_outputs[i][:n], f"r{i} diverged from HF"
