"""bench/gpu_check.sh's CPU-side parts: the dry run (plan and paper limits), argument parsing, the
bytes a decode step reads, and the switch between decode modes. The GPU sections themselves run
only on a GPU (docs/gpu.md)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from bench import gpu_check, gpu_engine_check as engine
from inferline.worker.engine.models.llama import LlamaForCausalLM
from inferline.worker.engine.models.loader import DUMMY_PRESETS

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_prints_the_plan_and_the_paper_limits(capsys, tmp_path):
    assert gpu_check.main(["--dry-run", "--markdown", str(tmp_path / "plan.md")]) == 0
    out = capsys.readouterr().out
    for section in (
        "1. correctness",
        "2. decode attention",
        "3. prefill",
        "4. load",
        "5. HF greedy",
    ):
        assert section in out
    assert "| 64 | 2048 | 16.06 | 17.18 | 6.93 | 9242 |" in out  # Llama-3-8B at 4.8 TB/s
    assert (tmp_path / "plan.md").read_text().strip() == out.strip()
    gpu_check.main(["--dry-run", "--skip-engine"])
    assert "4. load" not in capsys.readouterr().out


def test_the_script_runs_its_dry_run():
    proc = subprocess.run(
        [str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paper limit" in proc.stdout and "contexts [4096]" in proc.stdout


def test_the_modes_exclude_each_other():
    assert gpu_check.parse_args(["--cpu-smoke"]).cpu_smoke and not gpu_check.parse_args([]).dry_run
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--cpu-smoke", "--dry-run"])


@pytest.mark.parametrize("preset", sorted(DUMMY_PRESETS))
def test_weight_bytes_are_the_models_parameters(preset):
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**DUMMY_PRESETS[preset]), 64)
    assert engine.weight_bytes(DUMMY_PRESETS[preset]) == sum(
        2 * p.numel() for p in model.parameters()
    )


def test_the_decode_limit():
    shape = DUMMY_PRESETS["llama3-8b"]
    assert engine.kv_bytes_per_token(shape) == 32 * 2 * 8 * 128 * 2
    assert engine.decode_limit(1, 0, 10**9, 0, 1.0) == pytest.approx(
        1.0
    )  # 1 GB of weights at 1 GB/s
    assert engine.decode_limit(4, 1000, 10**9, 10**6, 2.0) == pytest.approx(
        4 * 2 / 5
    )  # 5 GB a step


def test_decode_mode_switches_the_runner_and_restores_it():
    runner = SimpleNamespace(padded_decode="padded", decode_graphs="graphs")
    with engine.decode_mode(runner, "off"):
        assert (runner.padded_decode, runner.decode_graphs) == (None, None)
    with engine.decode_mode(runner, "eager"):
        assert (runner.padded_decode, runner.decode_graphs) == ("padded", None)
    with engine.decode_mode(runner, "graphs"):
        assert (runner.padded_decode, runner.decode_graphs) == ("padded", "graphs")
    assert (runner.padded_decode, runner.decode_graphs) == ("padded", "graphs")


def test_a_section_that_raises_is_one_failure_and_the_run_goes_on(capsys):
    def broken():
        raise RuntimeError("no graph today")

    report = gpu_check.Report()
    assert gpu_check.guarded(report, "engine", broken) == 1
    assert gpu_check.guarded(report, "load", lambda: None) == 0
    assert gpu_check.guarded(report, "HF greedy", lambda: 2) == 2
    assert "**engine section failed**: RuntimeError: no graph today" in report.text()
