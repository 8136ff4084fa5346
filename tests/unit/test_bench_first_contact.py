"""bench/first_contact.py's CPU-side parts: the env section; the runner that guards, times,
budgets and writes each section (fake sections stand in for the GPU ones); the kernel checks'
verdicts with the Triton launchers replaced by the reference (right, or broken on purpose); the
decode paths; the bytes a decode step reads. The sections themselves run on the CPU in
`make gpu-rehearsal` (`--rehearse`) and for real only on a GPU (docs/gpu.md#first-contact)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from bench import first_contact as fc
from inferline.kernels import reference
from inferline.worker.engine.models.llama import LlamaForCausalLM
from inferline.worker.engine.models.loader import DUMMY_PRESETS


def test_env_section_reports_versions_and_where_imports_come_from(tmp_path):
    run = fc.Run("cpu", tmp_path / "fc.json", 60.0, rehearse=True)
    data = fc.section_env(run)
    assert data["versions"]["torch"] != "missing" and data["versions"]["triton"] != "missing"
    assert data["wheels"] == "none needed"  # the project's venv has structlog and pydantic
    assert data["imports"]["structlog"] == "installed"
    assert data["summary"].startswith("CPU;")


def test_sections_are_guarded_timed_budgeted_and_written_as_each_ends(tmp_path, capsys):
    out = tmp_path / "out" / "fc.json"
    run = fc.Run("cpu", out, budget_s=60.0)
    seen_by_second = {}

    def fine(run):
        return {"summary": "fine", "value": 1}

    def raises(run):
        seen_by_second.update(json.loads(out.read_text())["sections"])  # written already
        raise RuntimeError("boom")

    def fails(run):
        return {"summary": "off", "failures": ["decode: 1e-1 > 1e-2"]}

    def cuda_only(run):
        raise fc.Skip("needs CUDA")

    sections = [
        fc.Section("fine", fine, 1, 1),
        fc.Section("raises", raises, 1, 1),
        fc.Section("fails", fails, 1, 1),
        fc.Section("costly", fine, 3600, 3600),
        fc.Section("cuda-only", cuda_only, 1, 1),
        fc.Section("after", fine, 1, 1),
    ]
    assert fc.run_sections(run, sections) == 1
    assert seen_by_second["fine"]["status"] == "ok"
    doc = json.loads(out.read_text())
    status = {name: s["status"] for name, s in doc["sections"].items()}
    assert status == {
        "fine": "ok",
        "raises": "error",
        "fails": "fail",
        "costly": "skipped",
        "cuda-only": "skipped",
        "after": "ok",
    }
    assert "RuntimeError: boom" in doc["sections"]["raises"]["summary"]
    assert "boom" in doc["sections"]["raises"]["traceback"]
    assert doc["sections"]["costly"]["summary"].startswith("budget:")
    assert doc["sections"]["fine"]["value"] == 1 and doc["sections"]["fine"]["seconds"] >= 0
    table = capsys.readouterr().out.split("## First contact")[-1]
    assert all(f"| {name}" in table for name in status)
    assert "2 ok, 1 fail, 1 error, 2 skipped" in table


def test_a_run_of_passing_sections_exits_zero(tmp_path):
    run = fc.Run("cpu", tmp_path / "fc.json", budget_s=60.0)
    sections = [fc.Section("fine", lambda run: {"summary": "ok"}, 1, 1)]
    assert fc.run_sections(run, sections) == 0


def test_without_cuda_it_says_so_unless_rehearsing(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: main() would run the first contact")
    assert fc.main(["--out", str(tmp_path / "fc.json")]) == 2
    assert "--rehearse" in capsys.readouterr().out
    assert not (tmp_path / "fc.json").exists()


def reference_launchers(monkeypatch, decode=None):
    """The Triton launchers the kernel checks call, replaced by kernels/reference.py (`decode`:
    another decode, to break on purpose); nothing is launched or compiled."""
    from inferline.kernels.triton import decode as tdecode, prefill as tprefill, store as tstore

    def ref_decode(q, *args, out, **plan):
        return out.copy_(reference.paged_decode_attention(q, *args))

    def ref_prefill(q, *args, out):
        return out.copy_(reference.paged_prefill_attention(q, *args))

    monkeypatch.setattr(tdecode, "paged_decode_attention_triton", decode or ref_decode)
    monkeypatch.setattr(tprefill, "paged_prefill_attention_triton", ref_prefill)
    monkeypatch.setattr(tstore, "store_kv_triton", reference.store_kv)
    return ref_decode


def layouts(tmp_path):
    run = fc.Run("cpu", tmp_path / "fc.json", 60.0, rehearse=True)
    return fc.section_layouts(run)


def test_the_layout_checks_pass_a_right_kernel(monkeypatch, tmp_path):
    reference_launchers(monkeypatch)
    data = layouts(tmp_path)
    assert data["failures"] == [] and len(data["checks"]) == 2 * 5  # 2 layouts, 5 checks each
    assert data["skipped"] == ["int64 addressing: needs CUDA"]
    assert data["summary"].startswith("10/10 within tolerance")


@pytest.mark.parametrize("break_it", ["unwritten row", "off by 1e-3", "raises at block 32"])
def test_the_layout_checks_fail_a_wrong_kernel(monkeypatch, tmp_path, break_it):
    """NaN left in an output, an fp32 error over 1e-4, a layout that raises: each a failure, and
    the other layouts and checks still run."""
    right = reference_launchers(monkeypatch)

    def broken(q, k_cache, v_cache, tables, ctx, scale, out, **plan):
        if break_it == "unwritten row":  # the first sequence's row left as the caller filled it
            right(q[1:], k_cache, v_cache, tables[1:], ctx[1:], scale, out=out[1:])
            return out
        right(q, k_cache, v_cache, tables, ctx, scale, out=out)
        if break_it == "off by 1e-3":
            out.mul_(1.001)
        elif k_cache.shape[1] == 32:
            raise RuntimeError("no plan")
        return out

    reference_launchers(monkeypatch, broken)
    data = layouts(tmp_path)
    failed = {c["check"].split(" float32")[0] for c in data["checks"] if not c["ok"]}
    if break_it == "raises at block 32":
        assert len(data["failures"]) == 1 and "RuntimeError: no plan" in data["failures"][0]
        assert len(data["checks"]) == 5 + 1  # block 8's five checks, block 32's error
    else:
        assert failed == {"decode 1 split", "decode heuristic", "decode many splits"}
        assert len(data["failures"]) == 6 and "FAILED" in data["summary"]


def test_a_nan_is_never_within_tolerance():
    checks = fc.Checks()
    checks.add("nan", float("nan"), 1.0)
    checks.close("close", torch.ones(3), torch.ones(3) * (1 + 1e-5), 1e-4)
    checks.exact("store", False)
    assert [c["ok"] for c in checks.rows] == [False, True, False]
    assert checks.result()["summary"].startswith("1/3 within tolerance")


def test_decode_path_switches_the_runner_and_restores_it():
    runner = SimpleNamespace(padded_decode="padded", decode_graphs="graphs")
    runner.attention, runner.backends = "triton", "backends"
    seen = {}
    for mode in ("graphs", "eager", "flat"):
        with fc.decode_path(runner, mode):
            seen[mode] = (runner.padded_decode, runner.decode_graphs)
    assert seen == {
        "graphs": ("padded", "graphs"),
        "eager": ("padded", None),
        "flat": (None, None),
    }
    with pytest.raises(RuntimeError), fc.decode_path(runner, "flat"):
        raise RuntimeError("a step failed")
    assert (runner.padded_decode, runner.decode_graphs, runner.attention) == (
        "padded",
        "graphs",
        "triton",
    )


@pytest.mark.parametrize("preset", sorted(DUMMY_PRESETS))
def test_a_decode_step_reads_the_weights_but_the_embedding_and_each_tokens_kv(preset):
    shape = DUMMY_PRESETS[preset]
    config = LlamaConfig(**shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, 64).to(torch.bfloat16)
    runner = SimpleNamespace(model=model, config=config, kv_dtype=torch.bfloat16)
    read = fc.bytes_per_step(runner, context_total=1000)
    params = sum(p.numel() for p in model.parameters())
    embed = 0 if config.tie_word_embeddings else shape["vocab_size"] * shape["hidden_size"]
    assert read["weights"] == 2 * (params - embed)
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    kv = 2 * shape["num_key_value_heads"] * head_dim * 2 * shape["num_hidden_layers"]
    assert read["kv"] == 1000 * kv and read["total"] == read["weights"] + read["kv"]
