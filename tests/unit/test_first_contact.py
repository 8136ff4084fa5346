"""bench/first_contact.py's CPU-side parts: the env section, and the runner that guards, times,
budgets and writes each section (fake sections stand in for the GPU ones)."""

from __future__ import annotations

import json

import pytest
import torch

from bench import first_contact as fc


def test_env_section_reports_versions_and_where_imports_come_from(tmp_path):
    run = fc.Run("cpu", tmp_path / "fc.json", 60.0, rehearse=True)
    data = fc.section_env(run)
    assert data["versions"]["torch"] != "missing" and data["versions"]["triton"] != "missing"
    assert data["wheels"] == "none needed"  # the project's venv has structlog and pydantic
    assert data["imports"]["structlog"] == "installed" and data["stubbed"] == []
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
