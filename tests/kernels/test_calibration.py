"""models/calibration.py: `cpu_linear=auto` times its candidates on the model and keeps the fastest,
remembered per machine and shapes. The timings here are faked (a test never asserts a wall-clock
time); every backend it may choose is checked against HF in tests/unit/test_engine.py."""

from __future__ import annotations

import json

import pytest
import torch

from inferline.kernels import backends
from inferline.kernels.cpu import gemm
from inferline.worker.engine.models import calibration
from inferline.worker.engine.models.linear import onednn_available

needs_both = pytest.mark.skipif(
    not (gemm.available() and onednn_available()), reason="needs the C GEMM and oneDNN"
)


def tiny_model(num_layers: int = 6):
    from transformers import LlamaConfig

    from inferline.worker.engine.models.llama import LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config, max_positions=64).eval()


@pytest.fixture
def fake_speeds(monkeypatch):
    """Each pass costs `speeds[backend]` seconds (told apart by the packed weight's type)."""
    speeds = {"c": 1.0, "onednn": 2.0}
    calls = []

    def pass_seconds(ops, x_by_in, timer):
        backend = "c" if isinstance(ops[0][1], (gemm.PackedWeight, gemm.CodedWeight)) else "onednn"
        calls.append(backend)
        return speeds[backend]

    monkeypatch.setattr(calibration, "_pass_seconds", pass_seconds)
    monkeypatch.setattr(calibration, "BUDGET_S", 0.0)
    return speeds, calls


@needs_both
@pytest.mark.parametrize("faster", ["c", "onednn"])
def test_auto_keeps_the_faster_backend_and_remembers_it(tmp_path, fake_speeds, faster):
    speeds, calls = fake_speeds
    speeds[faster] = 0.5
    model, path = tiny_model(), tmp_path / "cal.json"
    first = calibration.choose_linear_backend(model, ("onednn", "c"), codes=True, path=path)
    assert first.backend == faster and not first.cached
    assert first.seconds[faster] < first.seconds[{"c": "onednn", "onednn": "c"}[faster]]
    rounds = calibration.MIN_ROUNDS + 1  # the first one warms up
    assert (
        calls.count("c") == calls.count("onednn") == 2 * len(calibration.ROWS) * rounds
    )  # layers, head
    entry = next(iter(json.loads(path.read_text()).values()))
    assert (
        entry["backend"] == faster
        and entry["cpu"] == calibration.cpu_model()
        and entry["num_layers"] == 6
    )

    calls.clear()
    again = calibration.choose_linear_backend(model, ("onednn", "c"), codes=True, path=path)
    assert again.backend == faster and again.cached and not calls


@needs_both
def test_the_estimate_scales_the_sampled_layers_to_the_whole_model(tmp_path, fake_speeds):
    """Layers and head cost 1 s a pass each: 4 of 12 layers sampled -> 3 x layers + head,
    per row."""
    model = tiny_model(12)
    seconds = calibration.measure(model, ("c",), codes=False)
    per_row = sum(1.0 / rows for rows in calibration.ROWS)
    assert seconds["c"] == pytest.approx(per_row * (12 / calibration.SAMPLE_LAYERS + 1))


@needs_both
def test_a_choice_is_kept_only_for_the_same_machine_threads_and_shapes(
    tmp_path, fake_speeds, monkeypatch
):
    _speeds, calls = fake_speeds
    path = tmp_path / "cal.json"
    calibration.choose_linear_backend(tiny_model(), ("onednn", "c"), codes=True, path=path)
    for change in ("threads", "cpu", "shapes"):
        calls.clear()
        model = tiny_model(7 if change == "shapes" else 6)
        if change == "threads":
            monkeypatch.setattr(torch, "get_num_threads", lambda: 99)
        if change == "cpu":
            monkeypatch.setattr(calibration, "cpu_model", lambda: "another CPU")
        assert not calibration.choose_linear_backend(
            model, ("onednn", "c"), codes=True, path=path
        ).cached
        assert calls, change
    assert len(json.loads(path.read_text())) == 4


def test_one_candidate_is_not_timed(tmp_path, fake_speeds):
    _speeds, calls = fake_speeds
    chosen = calibration.choose_linear_backend(
        tiny_model(), ("torch",), codes=True, path=tmp_path / "cal.json"
    )
    assert (
        chosen == calibration.Calibration("torch")
        and not calls
        and not (tmp_path / "cal.json").exists()
    )


@needs_both
def test_a_broken_cache_file_is_measured_again_and_replaced(tmp_path, fake_speeds):
    path = tmp_path / "cal.json"
    path.write_text("{not json")
    assert not calibration.choose_linear_backend(
        tiny_model(), ("onednn", "c"), codes=True, path=path
    ).cached
    assert calibration.choose_linear_backend(
        tiny_model(), ("onednn", "c"), codes=True, path=path
    ).cached


def test_auto_candidates_put_the_rule_first_and_explicit_settings_stand_alone(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(backends.gemm, "available", lambda: True)
    monkeypatch.setattr(backends, "onednn_available", lambda: True)
    for preferred, first in ((True, "c"), (False, "onednn")):
        monkeypatch.setattr(backends.gemm, "preferred", lambda p=preferred: p)
        assert backends.linear_candidates(cpu, torch.float32, "auto") == (
            first,
            {"c": "onednn", "onednn": "c"}[first],
        )
    assert backends.linear_candidates(cpu, torch.float32, "c") == ("c",)
    assert backends.linear_candidates(cpu, torch.float32, "torch") == ("torch",)
    assert backends.linear_candidates(cpu, torch.bfloat16, "auto") == ("torch",)
    assert backends.linear_candidates(cuda, torch.float32, "auto") == ("torch",)
    monkeypatch.setattr(backends, "onednn_available", lambda: False)
    assert backends.linear_candidates(cpu, torch.float32, "auto") == ("c",)


@needs_both
def test_the_real_timing_picks_one_that_runs(tmp_path):
    chosen = calibration.choose_linear_backend(
        tiny_model(), ("onednn", "c"), codes=False, path=tmp_path / "c.json"
    )
    assert chosen.backend in ("onednn", "c") and set(chosen.seconds) == {"onednn", "c"}
    assert all(s > 0 for s in chosen.seconds.values())
