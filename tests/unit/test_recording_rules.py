"""deploy/prometheus/vllm-names.yml: vLLM's metric names recorded from the worker's.

Each rule reads only series the worker's registry exports (names read as in test_dashboard.py);
a histogram is recorded whole (`_bucket`, `_sum` and `_count`, from the same suffix of one of
ours, `le` never aggregated away), a counter from a counter; and the vLLM names that
docs/operations.md lists are exactly the ones recorded. promtool (deploy/prometheus/tools.sh) checks
the file, the alerts and compose's prometheus.yml too; where `promql-parser` is installed, every
expression parses.
"""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from tests.prometheus_tools import prometheus_tool
from tests.unit.test_dashboard import (
    ALERTS,
    PROMETHEUS,
    REPO,
    exported_series_names,
    promql_metric_names,
)

RULES = PROMETHEUS.parent / "vllm-names.yml"
HISTOGRAM = ("_bucket", "_sum", "_count")


def records() -> dict[str, str]:
    """record name -> expression, for every rule of the file."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert all(set(rule) == {"record", "expr"} for rule in rules), "recording rules only"
    out = {rule["record"]: rule["expr"] for rule in rules}
    assert len(out) == len(rules), "a name recorded twice"
    return out


def documented_vllm_names() -> set[str]:
    """The vLLM names in the operations guide, a histogram's suffixes dropped."""
    text = (REPO / "docs" / "operations.md").read_text()
    names = set(re.findall(r"\bvllm:[a-z0-9_]*[a-z]", text))
    return {re.sub(r"_(bucket|sum|count)$", "", name) for name in names}


def test_the_prometheus_config_loads_the_rules():
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert RULES.name in config["rule_files"]


def test_every_rule_reads_only_exported_series():
    exported = exported_series_names()
    for name, expr in records().items():
        assert name.startswith("vllm:"), name
        used = promql_metric_names(expr)
        assert used and used <= exported, f"{name}: {sorted(used - exported)} not exported"


def test_histograms_are_recorded_whole_and_counters_from_counters():
    rules = records()
    for name, expr in rules.items():
        (source,) = promql_metric_names(expr)
        suffix = next((s for s in (*HISTOGRAM, "_total") if name.endswith(s)), None)
        assert suffix is not None, f"{name}: not a histogram series or a counter"
        assert source.endswith(suffix), f"{name} is recorded from {source}"
        if suffix in HISTOGRAM:
            base = name.removesuffix(suffix)
            assert all(base + s in rules for s in HISTOGRAM), f"{base}: not recorded whole"
        # Only `priority` may be aggregated away: `le` and model_name stay.
        assert not re.search(r"\bby\s*\(", expr), name
        for labels in re.findall(r"\bwithout\s*\(([^)]*)\)", expr):
            assert {x.strip() for x in labels.split(",")} == {"priority"}, name


def test_the_documented_vllm_names_are_the_recorded_ones():
    recorded = {re.sub(r"_(bucket|sum|count)$", "", name) for name in records()}
    documented = documented_vllm_names()
    assert documented == recorded
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    ):
        assert name in recorded, name


def test_the_rules_parse_as_promql():
    promql_parser = pytest.importorskip("promql_parser")
    for name, expr in records().items():
        promql_parser.parse(expr)
        promql_parser.parse(name)  # a name with colons is a valid metric name


@pytest.mark.parametrize(
    "what, path",
    [("rules", RULES), ("rules", ALERTS), ("config", PROMETHEUS)],
    ids=["recording-rules", "alerts", "prometheus.yml"],
)
def test_promtool_accepts_the_files(what, path):
    promtool = prometheus_tool("promtool")
    done = subprocess.run([promtool, "check", what, str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
