"""The engine against HF transformers: greedy continuous batching must equal `generate`."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from tests.engine_fixtures import NEW_TOKENS, greedy, make_engine, run_to_completion
from inferline.worker.engine.request import EngineRequest, SamplingParams


def request(i: int, ids: list[int], max_tokens: int = NEW_TOKENS, **kw) -> EngineRequest:
    return EngineRequest(
        request_id=f"r{i}", prompt_token_ids=ids, sampling=greedy(max_tokens, **kw)
    )


def staggered(prompts) -> dict[int, list[EngineRequest]]:
    """Requests arriving at different steps: 4 at once, then one every other step."""
    arrivals: dict[int, list[EngineRequest]] = {
        0: [request(i, p) for i, p in enumerate(prompts[:4])]
    }
    for i, ids in enumerate(prompts[4:], start=4):
        arrivals.setdefault(2 * (i - 3), []).append(request(i, ids))
    return arrivals


def test_hf_outputs_are_long_enough(hf_outputs):
    assert all(len(out) == NEW_TOKENS for out in hf_outputs), [len(o) for o in hf_outputs]


def test_continuous_batch_equals_hf_generate(model_runner, prompts, hf_outputs):
    # A small token budget forces chunked prefill next to running decodes.
    engine = make_engine(model_runner, max_num_batched_tokens=64, max_num_seqs=16)
    results = run_to_completion(engine, staggered(prompts))
    for i, expected in enumerate(hf_outputs):
        assert results[f"r{i}"]["tokens"] == expected, f"prompt {i} diverged from HF generate"
        assert results[f"r{i}"]["started"] == 1


def test_alone_equals_inside_a_batch_of_30(model_runner, prompts):
    alone = run_to_completion(make_engine(model_runner), {0: [request(0, prompts[3])]})
    others = [
        request(100 + j, prompts[j % len(prompts)][: 20 + 7 * j], max_tokens=20 + j)
        for j in range(30)
    ]
    crowd = run_to_completion(
        make_engine(model_runner), {0: others[:15], 1: [request(0, prompts[3])], 3: others[15:]}
    )
    assert crowd["r0"]["tokens"] == alone["r0"]["tokens"]


def logits_rows_of(model_runner, prompt: list[int], arrivals) -> list[torch.Tensor]:
    """Every logits row the sampler got for the request whose prompt is `prompt`, step by step."""
    rows, sample = [], model_runner.sampler.sample_on_device

    def capture(logits, params, prompt_ids, *rest):
        rows.extend(logits[i].clone() for i, ids in enumerate(prompt_ids) if ids == prompt)
        return sample(logits, params, prompt_ids, *rest)

    model_runner.sampler.sample_on_device = capture  # an instance attribute over the method
    try:
        run_to_completion(make_engine(model_runner), arrivals)
    finally:
        del model_runner.sampler.sample_on_device
    return rows


def test_alone_and_in_a_batch_the_logits_are_the_same_bits(model_runner, prompts):
    """Stronger than equal tokens: a sequence decoding alone (one-row steps) computes exactly
    what it computes among others. (On an Intel Xeon, oneDNN's one-row kernel for long rows once
    broke this without changing a token here: models/linear.py, lone_row_exact.)"""
    mine = prompts[5]
    alone = logits_rows_of(model_runner, mine, {0: [request(0, mine, max_tokens=12)]})
    others = [request(100 + j, prompts[j][: 30 + 9 * j], max_tokens=14) for j in (0, 1, 2, 3, 4, 6)]
    crowd = logits_rows_of(
        model_runner, mine, {0: others[:3], 1: [request(0, mine, max_tokens=12)], 2: others[3:]}
    )
    assert len(alone) == len(crowd) == 12
    for step, (a, b) in enumerate(zip(alone, crowd)):
        assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max().item():.3g}"


def test_preemption_under_a_tiny_kv_cache_keeps_greedy_output(model_runner, prompts, hf_outputs):
    chosen = list(range(8))
    reqs = {0: [request(i, prompts[i]) for i in chosen]}
    big = run_to_completion(make_engine(model_runner), reqs)
    # Each request needs ~6-10 blocks; 24 blocks hold about three of them.
    engine = make_engine(model_runner, num_blocks=24)
    small = run_to_completion(engine, {0: [request(i, prompts[i]) for i in chosen]})
    assert engine.stats().num_preemptions > 0
    for i in chosen:
        assert small[f"r{i}"]["tokens"] == big[f"r{i}"]["tokens"] == hf_outputs[i]
    assert engine.block_manager.num_free_blocks == 24


def test_prefix_cache_skips_shared_prefixes_and_keeps_greedy_output(
    model_runner, prompts, hf_outputs
):
    engine = make_engine(model_runner, max_num_batched_tokens=64)
    first = run_to_completion(engine, {0: [request(i, prompts[i]) for i in range(4)]})
    before = engine.stats()
    # The same prompts again (each whole prompt but its last block is cached), plus new ones
    # sharing only the chat template's opening: all must still equal HF token for token.
    again = {
        0: [request(10 + i, prompts[i]) for i in range(4)]
        + [request(i, prompts[i]) for i in range(4, 8)]
    }
    second = run_to_completion(engine, again)
    after = engine.stats()
    for i in range(4):
        assert first[f"r{i}"]["tokens"] == second[f"r{10 + i}"]["tokens"] == hf_outputs[i]
    for i in range(4, 8):
        assert second[f"r{i}"]["tokens"] == hf_outputs[i]
    full_reuse = sum((len(prompts[i]) - 1) // 16 * 16 for i in range(4))
    assert after.prefix_cache_hits - before.prefix_cache_hits >= full_reuse
    assert after.prefix_cache_queries - before.prefix_cache_queries == sum(
        len(prompts[i]) for i in range(8)
    )
    # Without the cache, the first wave's computed tokens are all recomputed: no hits at all.
    off = make_engine(model_runner, enable_prefix_caching=False)
    run_to_completion(off, {0: [request(i, prompts[i], max_tokens=2) for i in range(2)]})
    run_to_completion(off, {0: [request(i, prompts[i], max_tokens=2) for i in range(2)]})
    assert off.stats().prefix_cache_hits == 0


@pytest.mark.parametrize(
    "setting, value",
    [
        ("cpu_linear", "torch"),
        ("cpu_linear", "onednn"),
        ("cpu_linear", "c"),
        ("cpu_weight_codes", "off"),
        ("cpu_fused_ops", "torch"),
        ("attention_backend", "torch"),
    ],
)
def test_every_cpu_path_equals_hf_generate_too(model_runner, prompts, hf_outputs, setting, value):
    """The default runner packs its linear weights for the C GEMM (as 8-bit codes: the GGUF's
    weights are Q4_1 and Q8_0) or oneDNN, whichever `auto` timed faster here
    (models/calibration.py), runs norms, SiLU and rope as C kernels (kernels/fused.py) and
    attention, prompt rows included, in the C kernel (kernels/cpu/); a runner with any other linear
    backend, fp32 panels (INFERLINE_MODEL__CPU_WEIGHT_CODES=off), or the others on PyTorch
    (CPU_FUSED_OPS or ATTENTION_BACKEND = torch), must give HF's greedy tokens too."""
    from inferline.config.settings import Settings
    from inferline.kernels import backends, fused
    from inferline.kernels.cpu import gemm
    from inferline.worker.engine.model_runner import ModelRunner
    from inferline.worker.engine.models.linear import Linear, onednn_available

    cpu = torch.device("cpu")
    candidates = backends.linear_candidates(
        cpu, torch.float32, "auto"
    )  # auto keeps the fastest here
    assert model_runner.backends.linear == model_runner.linear_calibration.backend in candidates
    assert "torch" not in candidates
    assert (model_runner.backends.fused_ops == "c") == fused.available(cpu, torch.float32)
    if value == "onednn" and not onednn_available():
        pytest.skip("this PyTorch has no oneDNN")
    settings = Settings()
    setattr(settings.model, setting, value)
    settings.cache.num_blocks = 64
    plain = ModelRunner(settings)
    if setting == "cpu_linear":
        assert plain.backends.linear == value
        packed = [m.packed for m in plain.model.modules() if isinstance(m, Linear)] + [
            plain.model.lm_head_packed
        ]
        if value == "torch":
            assert all(p is None for p in packed)
        else:  # the C GEMM keeps every weight of this GGUF model as codes
            assert all(
                isinstance(p, gemm.CodedWeight) == (value == "c") and p is not None for p in packed
            )
            assert plain.coded_weights == (len(packed) if value == "c" else 0)
    elif setting == "cpu_weight_codes":
        assert (
            plain.coded_weights == 0 and plain.backends.linear in candidates
        )  # timed again: codes off
        if plain.backends.linear == "c":
            packed = plain.model.packed_weights()
            assert len(packed) == 121 and all(isinstance(p, gemm.PackedWeight) for p in packed)
    elif setting == "cpu_fused_ops":
        assert plain.backends.fused_ops == "torch" and plain.backends.linear in candidates
    else:
        assert plain.backends.attention == "torch"
    results = run_to_completion(
        make_engine(plain), {0: [request(i, prompts[i], max_tokens=24) for i in range(4)]}
    )
    for i in range(4):
        assert results[f"r{i}"]["tokens"] == hf_outputs[i][:24]


def test_a_second_engine_on_the_runner_takes_its_kv_cache_over(model_runner, prompts):
    """Two block managers over one KV cache would overwrite each other's blocks silently: the
    engine built last owns the runner, and the earlier one fails loudly on its next step."""
    first = make_engine(model_runner)
    first.add_request(request(0, prompts[0], max_tokens=4))
    first.step()
    second = make_engine(model_runner)
    with pytest.raises(RuntimeError, match="claimed by a newer LLMEngine"):
        first.step()
    done = run_to_completion(second, {0: [request(1, prompts[1], max_tokens=4)]})
    assert len(done["r1"]["tokens"]) == 4


def test_static_policy_matches_and_batches(model_runner, prompts, hf_outputs):
    engine = make_engine(model_runner, policy="static", max_num_seqs=4)
    results = run_to_completion(
        engine, {0: [request(i, prompts[i], max_tokens=8 + 4 * i) for i in range(6)]}
    )
    for i in range(6):
        assert results[f"r{i}"]["tokens"] == hf_outputs[i][: 8 + 4 * i]
    # r4 could only start once the whole first batch of four had finished.
    assert (
        results["r4"]["final"].queue_s
        >= max(results[f"r{i}"]["final"].total_s for i in range(4)) - 1e-3
    )


def test_a_batch_beside_an_interactive_request_yields_its_steps_and_keeps_greedy_output(
    model_runner, prompts, hf_outputs
):
    """Priority 100 is background work: the interactive prompt's step carries no batch sequence,
    and beside the interactive request the batch computes at most background_max_tokens tokens a
    step (its prompts in chunks)."""
    engine = make_engine(model_runner, max_num_seqs=16, background_max_tokens=2)
    steps: list[set[str]] = []
    background_tokens: list[int] = []  # of each step beside the interactive request
    schedule = engine.scheduler.schedule

    def recorded():
        out = schedule()
        steps.append({c.seq.request_id for c in out.scheduled})
        if "r0" in steps[-1]:
            background_tokens.append(
                sum(c.num_new_tokens for c in out.scheduled if c.seq.priority == 100)
            )
        return out

    engine.scheduler.schedule = recorded
    batch = [
        EngineRequest(
            request_id=f"r{i}",
            prompt_token_ids=prompts[i],
            sampling=greedy(NEW_TOKENS),
            priority=100,
        )
        for i in range(1, 6)
    ]
    chat = request(0, prompts[0])
    results = run_to_completion(engine, {0: batch, 3: [chat]})
    for i in range(6):
        assert results[f"r{i}"]["tokens"] == hf_outputs[i], f"prompt {i} diverged from HF generate"
    beside = [s for s in steps if "r0" in s]
    assert beside[0] == {"r0"}, "the interactive prompt's step carried batch sequences"
    assert max(background_tokens) <= 2 and any(background_tokens), background_tokens
    assert max(len(s) for s in steps[:3]) == 5, "alone, the batch ran at full width"


def test_seeded_sampling_is_reproducible_inside_any_batch(model_runner, prompts):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)

    def seeded(rid):
        return EngineRequest(request_id=rid, prompt_token_ids=prompts[5], sampling=params)

    alone = run_to_completion(make_engine(model_runner), {0: [seeded("s")]})
    noisy = [
        EngineRequest(
            request_id=f"n{j}",
            prompt_token_ids=prompts[j],
            sampling=SamplingParams(max_tokens=10, temperature=1.0),
        )
        for j in range(6)
    ]
    crowd = run_to_completion(
        make_engine(model_runner), {0: noisy[:3], 1: [seeded("s")], 2: noisy[3:]}
    )
    assert crowd["s"]["tokens"] == alone["s"]["tokens"]
    other_seed = EngineRequest(
        request_id="o",
        prompt_token_ids=prompts[5],
        sampling=SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=99),
    )
    assert (
        run_to_completion(make_engine(model_runner), {0: [other_seed]})["o"]["tokens"]
        != alone["s"]["tokens"]
    )


def test_stop_string_never_leaks(model_runner, prompts, hf_outputs):
    full = model_runner.tokenizer.decode(hf_outputs[0], skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 6]
    assert stop.strip(), "pick a non-blank stop string"
    results = run_to_completion(
        make_engine(model_runner), {0: [request(0, prompts[0], stop=(stop,))]}
    )
    r = results["r0"]
    assert r["final"].finish_reason == "stop"
    assert stop not in r["text"] and r["text"] == r["final"].text
    assert full.startswith(r["text"]) and len(r["text"]) == full.index(stop)


def test_impossible_requests_are_rejected_at_once(model_runner):
    engine = make_engine(model_runner, num_blocks=4)
    results = run_to_completion(
        engine,
        {
            0: [
                EngineRequest(request_id="long", prompt_token_ids=[1] * 60, sampling=greedy(10)),
                EngineRequest(
                    request_id="model",
                    prompt_token_ids=[1] * 10,
                    sampling=greedy(engine.max_model_len),
                ),
                EngineRequest(request_id="vocab", prompt_token_ids=[10**7], sampling=greedy(4)),
                EngineRequest(request_id="empty", prompt="", sampling=greedy(4)),
                EngineRequest(request_id="ok", prompt_token_ids=[1, 2, 3], sampling=greedy(4)),
            ]
        },
    )
    assert results["long"]["final"].error_code == "prompt_too_long"
    assert results["model"]["final"].error_code == "prompt_too_long"
    assert results["vocab"]["final"].error_code == "invalid_request"
    assert results["empty"]["final"].error_code == "invalid_request"
    assert all(
        results[k]["final"].finish_reason == "rejected" for k in ("long", "model", "vocab", "empty")
    )
    assert results["ok"]["final"].finish_reason == "length"


def test_abort_and_deadline_free_blocks_at_once(model_runner, prompts):
    import time

    engine = make_engine(model_runner)
    engine.add_request(request(0, prompts[0], max_tokens=200))
    engine.add_request(
        EngineRequest(
            request_id="late",
            prompt_token_ids=prompts[1],
            sampling=greedy(200),
            deadline=time.time() - 1,
        )
    )
    outputs = {o.request_id: o for o in engine.step()}  # the expired one ends in this step
    assert "r0" not in outputs or not outputs["r0"].finished
    engine.abort("r0", "cancelled")
    outputs.update({o.request_id: o for o in engine.step()})
    assert outputs["r0"].finish_reason == "cancelled" and outputs["r0"].error_code == "cancelled"
    assert outputs["late"].finish_reason == "timeout" and outputs["late"].error_code == "timeout"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests()


def test_engine_loop_thread_delivers_everything(model_runner, prompts):
    import threading

    from inferline.worker.engine.engine import EngineLoop

    done, lock, finished = {}, threading.Lock(), threading.Event()

    def on_outputs(outputs, stats):
        with lock:
            for o in outputs:
                if o.finished:
                    done[o.request_id] = o
            if len(done) == 5:
                finished.set()

    loop = EngineLoop(make_engine(model_runner), on_outputs)
    loop.start()
    for i in range(4):
        loop.add_request(request(i, prompts[i], max_tokens=6))
    loop.add_request(request(4, prompts[4], max_tokens=500))
    loop.abort("r4", "cancelled")
    assert finished.wait(120)
    loop.stop(5)
    assert {o.finish_reason for k, o in done.items() if k != "r4"} == {"length"}
    assert done["r4"].finish_reason == "cancelled"


def test_engine_loop_builds_its_engine_on_its_own_thread(model_runner, prompts):
    """Given a factory, the loop loads the engine on the thread that will step it (EngineLoop's
    docstring: an OpenMP pool left on a loading thread slows every step), and wait_ready hands
    the engine over once built."""
    import threading

    from inferline.worker.engine.engine import EngineLoop

    built_on, outputs = [], []

    def build():
        built_on.append(threading.current_thread())
        return make_engine(model_runner)

    gc.unfreeze()  # whatever an earlier test froze
    loop = EngineLoop(build, lambda outs, stats: outputs.extend(outs))
    loop.start()
    engine = loop.wait_ready(60)
    assert built_on == [loop._thread] and loop.engine is engine
    assert gc.get_freeze_count() > 0  # what lives now is left out of later collections
    loop.add_request(request(0, prompts[0], max_tokens=3))
    deadline = time.monotonic() + 60
    while not any(o.finished for o in outputs) and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop(5)
    assert [o.finish_reason for o in outputs if o.finished] == ["length"]
    assert gc.get_freeze_count() == 0  # stopped: collectable again


def test_engine_loop_build_error_reaches_wait_ready():
    from inferline.worker.engine.engine import EngineLoop

    def build():
        raise FileNotFoundError("no such model")

    loop = EngineLoop(build, lambda outs, stats: None)
    loop.start()
    with pytest.raises(FileNotFoundError, match="no such model"):
        loop.wait_ready(10)
    loop.stop(5)
    assert not loop._thread.is_alive()


def test_stop_token_checks_are_set_lookups():
    """Every generated token is looked up in the stop ids and the EOS ids: sets, so a request's
    1024 stop ids cost what one does. No model: the check alone, on stand-ins."""
    from types import SimpleNamespace

    from inferline.worker.engine.engine import LLMEngine, eos_token_ids

    params = SamplingParams(max_tokens=100, stop_token_ids=tuple(range(1000, 2024)))
    assert isinstance(params.stop_token_ids, frozenset) and len(params.stop_token_ids) == 1024
    eos = eos_token_ids(SimpleNamespace(eos_token_id=[2, 3]), None)
    assert eos == frozenset({2, 3})
    engine = SimpleNamespace(eos_token_ids=eos, max_model_len=4096)
    seq = SimpleNamespace(sampling=params, num_output_tokens=1, num_tokens=10)
    reasons = {t: LLMEngine._stop_reason(engine, seq, t) for t in (999, 1000, 2023, 2024, 3)}
    assert reasons == {999: None, 1000: "stop", 2023: "stop", 2024: None, 3: "stop"}


def test_cpu_threads_setting_sets_torch_threads(monkeypatch):
    """INFERLINE_MODEL__CPU_THREADS reaches torch before the model is built."""
    import inferline.worker.engine.engine as engine_module
    from inferline.config.settings import Settings

    seen = {}

    class Runner:  # the model itself is irrelevant here: only when the threads are set
        def __init__(self, settings):
            seen["threads_at_build"] = torch.get_num_threads()

    before = torch.get_num_threads()
    monkeypatch.setattr(engine_module, "ModelRunner", Runner)
    monkeypatch.setattr(engine_module.LLMEngine, "__init__", lambda self, runner, settings: None)
    monkeypatch.setenv("INFERLINE_MODEL__CPU_THREADS", "1")
    try:
        engine_module.LLMEngine.from_settings(Settings())
        assert seen["threads_at_build"] == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    monkeypatch.delenv("INFERLINE_MODEL__CPU_THREADS")
    engine_module.LLMEngine.from_settings(Settings())  # 0: left as it was
    assert torch.get_num_threads() == before


def smaps_kb(address: int, field: str = "AnonHugePages") -> int:
    """A field (kB) of /proc/self/smaps for this process's mapping that holds `address`."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == field + ":":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_cpu_kv_cache_is_advised_onto_huge_pages(model_runner):
    """huge_page_tensor: a writable tensor of its own mapping, on 2 MB pages wherever the host's
    THP mode allows it (`madvise` or `always`); elsewhere plain pages, never an error. Zeroed,
    and every page resident from the start: no step pays a page's first touch."""
    from pathlib import Path

    from inferline.worker.engine.model_runner import huge_page_tensor

    t = huge_page_tensor((8, 512, 1024), torch.float32)  # 16 MB
    assert t.shape == (8, 512, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    assert smaps_kb(t.data_ptr(), "Rss") >= 16 << 10, "the pages were not touched at allocation"
    assert not t.any()
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * t.numel()
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    thp = mode.exists() and ("[madvise]" in mode.read_text() or "[always]" in mode.read_text())
    if thp:
        assert smaps_kb(t.data_ptr() + (8 << 20)) > 0, "the advice did not give 2 MB pages"
    k_cache, v_cache = model_runner.kv_cache[0]
    assert k_cache.data_ptr() != v_cache.data_ptr() and not k_cache.is_cuda


def test_max_tokens_left_out_is_what_the_model_length_leaves(model_runner):
    """Issue 50, item 5, as vLLM: a request without max_tokens (fit_to_model_len) runs to what the
    model length leaves after its prompt, at most the worker's cap; one whose max_tokens cannot
    fit is rejected naming max_tokens, and a prompt that fills the model length names the prompt."""
    engine = make_engine(model_runner)
    engine.max_model_len = 24
    prompt = list(range(100, 120))  # 20 tokens: 4 left
    fit = dict(ignore_eos=True, fit_to_model_len=True)
    results = run_to_completion(
        engine,
        {
            0: [
                EngineRequest(
                    request_id="left", prompt_token_ids=prompt, sampling=greedy(1024, **fit)
                ),
                EngineRequest(
                    request_id="cap", prompt_token_ids=prompt[:10], sampling=greedy(3, **fit)
                ),
                EngineRequest(request_id="asked", prompt_token_ids=prompt, sampling=greedy(5)),
                EngineRequest(
                    request_id="full", prompt_token_ids=[1] * 24, sampling=greedy(9, **fit)
                ),
            ]
        },
    )
    left, cap, asked, full = (results[k]["final"] for k in ("left", "cap", "asked", "full"))
    assert (left.finish_reason, left.num_output_tokens) == ("length", 4)
    assert (cap.finish_reason, cap.num_output_tokens) == ("length", 3)
    assert (asked.finish_reason, asked.error_code) == ("rejected", "prompt_too_long")
    assert asked.error_message.startswith("max_tokens: 5 does not fit"), asked.error_message
    assert (full.finish_reason, full.error_code) == ("rejected", "prompt_too_long")
    assert full.error_message.startswith("prompt (24 tokens)"), full.error_message


def test_max_tokens_left_out_is_at_most_what_the_kv_cache_holds(model_runner):
    """Left out, max_tokens is never more than the whole KV cache holds beside the prompt: such a
    request runs instead of being rejected for a max_tokens it did not ask for."""
    engine = make_engine(model_runner, num_blocks=3)
    bs, prompt = engine.block_manager.block_size, list(range(100, 120))
    sampling = greedy(1024, ignore_eos=True, fit_to_model_len=True)
    results = run_to_completion(
        engine, {0: [EngineRequest(request_id="kv", prompt_token_ids=prompt, sampling=sampling)]}
    )
    final = results["kv"]["final"]
    assert (final.finish_reason, final.num_output_tokens) == ("length", 3 * bs - len(prompt))


def test_a_requests_queue_time_never_exceeds_its_time_to_first_token(model_runner, monkeypatch):
    """A step's first tokens and the start of the requests it ran share one clock reading (the
    overlapped step's merge read the clock twice: queue_s came out above ttft_s, caught by a
    broker test once in CI). A clock that moves on every reading makes a second reading show."""
    import itertools
    from types import SimpleNamespace

    import inferline.worker.engine.engine as engine_module
    from inferline.config.settings import Settings
    from inferline.worker.app import engine_settings
    from inferline.worker.engine.engine import LLMEngine

    ticks = itertools.count(1_000.0)
    clock = SimpleNamespace(
        time=lambda: next(ticks), perf_counter=time.perf_counter, monotonic=time.monotonic
    )
    monkeypatch.setattr(engine_module, "time", clock)
    eng = LLMEngine(model_runner, engine_settings(Settings()))
    eng.add_request(
        EngineRequest("q", SamplingParams(max_tokens=2), prompt="Hello", arrival_time=999.0)
    )
    final = run_to_completion(eng, check=False)["q"]["final"]
    assert 0 <= final.queue_s <= final.ttft_s <= final.total_s
