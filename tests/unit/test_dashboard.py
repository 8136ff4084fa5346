"""The Grafana dashboard and the Prometheus config in deploy/, checked against the worker's metrics.

Every metric name that a dashboard query, a template variable or an alert rule uses must be one
that worker.metrics or the gateway's metrics export, with the suffixes Prometheus exposition adds
(counter `_total`, histogram `_bucket`/`_sum`/`_count`); and every exported metric is on the
dashboard. tests/kafka/test_dashboard_queries.py runs every query on a real Prometheus. PromQL names
are read by a small lexer below (strings, label matchers, ranges and grouping clauses removed;
what remains and is not a function call or keyword is a metric name). Where the optional
`promql-parser` package is installed, every query is also parsed by it, and its names must agree.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from inferline.producer.gateway.metrics import GatewayMetrics
from inferline.worker.service.metrics import Metrics

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "inferline.json"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "inferline.yml"

# Series Prometheus makes itself for every scrape target.
PROMETHEUS_SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


# --------------------------------------------------------------------------- exported names


def metric_families() -> dict[str, str]:
    """name -> type of every metric family on fresh worker and gateway registries."""
    registries = (Metrics().registry, GatewayMetrics().registry)
    return {fam.name: fam.type for r in registries for fam in r.collect()}


def exported_series_names() -> set[str]:
    return {name + suffix for name, kind in metric_families().items() for suffix in SUFFIXES[kind]}


def rendered_series_names() -> set[str]:
    """Sample names of real /metrics pages (the worker's and the gateway's), with every labelled
    metric given one child."""
    names = set()
    for metrics in (Metrics(), GatewayMetrics()):
        for obj in vars(metrics).values():
            if isinstance(obj, MetricWrapperBase) and obj._labelnames:
                obj.labels(*["x"] * len(obj._labelnames))
        text = metrics.render().decode()
        names |= {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    return names


def test_derived_names_are_the_exposed_names():
    rendered = rendered_series_names()
    assert rendered, "the registry rendered no samples"
    assert rendered == exported_series_names()


# --------------------------------------------------------------------------- PromQL names

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(\s*\()?")
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
    "atan2",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (Grafana variables allowed where labels/ranges go)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        word, call = match.group(1), match.group(2)
        if call or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


@pytest.mark.parametrize(
    "expr, names",
    [
        ('up{job="inferline"} == 0', {"up"}),
        (
            "histogram_quantile(0.99, sum by (le) "
            '(rate(a_bucket{x=~"$v", y="by (z)"}[$__rate_interval])))',
            {"a_bucket"},
        ),
        (
            "sum(rate(b_total[5m] offset 1h)) by (instance) / on (instance) group_left c",
            {"b_total", "c"},
        ),
        ("min_over_time(d[10m]) == 1 and e > 1e3 unless f:recorded", {"d", "e", "f:recorded"}),
        ("sum without (le) (g) > bool 0.5", {"g"}),
    ],
)
def test_promql_metric_names(expr, names):
    assert promql_metric_names(expr) == names


# --------------------------------------------------------------------------- the dashboard


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # panels inside a collapsed row
    return out


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    queries = [
        (f"panel {p['title']!r} {t['refId']}", t["expr"])
        for p in all_panels(dashboard)
        for t in p.get("targets", [])
    ]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            inner = re.fullmatch(
                r"label_values\((.*),\s*\w+\)", q
            )  # label_values(<selector>, <label>)
            queries.append((f"variable {var['name']}", inner.group(1) if inner else q))
    return queries


def alert_queries() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [
        (f"rule {r.get('alert') or r.get('record')}", r["expr"])
        for g in rules["groups"]
        for r in g["rules"]
    ]


def unknown_names(queries: list[tuple[str, str]]) -> list[str]:
    known = exported_series_names() | PROMETHEUS_SYNTHETIC
    return [
        f"{where}: {name}"
        for where, expr in queries
        for name in sorted(promql_metric_names(expr) - known)
    ]


def test_every_dashboard_metric_is_exported(dashboard):
    queries = dashboard_queries(dashboard)
    assert len(queries) > 20
    assert not unknown_names(queries), "queried but exported by neither the worker nor the gateway"


def test_every_alert_metric_is_exported():
    queries = alert_queries()
    assert queries
    assert not unknown_names(queries), "queried but exported by neither the worker nor the gateway"


def test_every_exported_metric_is_on_the_dashboard(dashboard):
    used = set().union(*(promql_metric_names(q) for _, q in dashboard_queries(dashboard)))
    families = metric_families()
    missing = [
        name
        for name, kind in families.items()
        if not any(name + suffix in used for suffix in SUFFIXES[kind])
    ]
    assert not missing, f"exported but on no panel: {missing}"


def test_quantiles_aggregate_buckets_by_le(dashboard):
    queries = dashboard_queries(dashboard) + alert_queries()
    hq = [(w, q) for w, q in queries if "histogram_quantile" in q]
    assert len(hq) >= 12
    for where, q in hq:
        assert re.search(r"rate\(\w+_bucket\{", q), (
            f"{where}: histogram_quantile over a rate of _bucket"
        )
        assert re.search(r"\bby \((?:[\w, ]*, )?le\b", q), f"{where}: the sum must keep `le`"


def test_the_issue_panels_are_there(dashboard):
    titles = " | ".join(p["title"].lower() for p in all_panels(dashboard))
    for wanted in (
        "requests finished",
        "output tokens",
        "time to first token",
        "inter-token latency",
        "end-to-end latency",
        "running and waiting",
        "kv cache usage",
        "batch size",
        "iteration latency",
        "preemptions",
        "rejections",
        "consumer lag",
        "gateway requests",
        "gateway status codes",
        "gateway time to first token",
        "gateway streams open",
    ):
        assert wanted in titles, f"no panel for {wanted!r}"
    for title in (
        "Time to first token",
        "Inter-token latency",
        "End-to-end latency",
        "Iteration latency",
    ):
        (panel,) = [p for p in all_panels(dashboard) if p["title"] == title]
        exprs = [t["expr"] for t in panel["targets"]]
        assert [re.match(r"histogram_quantile\(([\d.]+),", e).group(1) for e in exprs] == [
            "0.5",
            "0.9",
            "0.99",
        ]
        assert panel["fieldConfig"]["defaults"]["unit"] == "s"


def test_dashboard_layout_and_references(dashboard):
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
        if p["type"] == "row":
            continue
        targets = p["targets"]
        assert targets and len({t["refId"] for t in targets}) == len(targets), p["title"]
        for ds in [p["datasource"]] + [t["datasource"] for t in targets]:
            assert ds == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        for t in targets:
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var.startswith("__") or var in variables, (
                    f"{p['title']!r}: ${var} is not a variable"
                )
        assert p.get("description"), f"{p['title']!r} has no description"


def grafana_to_promql(expr: str) -> str:
    """Substitute Grafana's variables so the text is plain PromQL."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: "1m" if m.group(1).startswith("__") else ".*", expr)


def test_queries_parse_as_promql(dashboard):
    promql_parser = pytest.importorskip("promql_parser")
    for where, q in dashboard_queries(dashboard) + alert_queries():
        text = grafana_to_promql(q)
        try:
            ast = promql_parser.parse(text)
        except Exception as exc:  # the binding raises its own error types
            pytest.fail(f"{where}: {text}: {exc}")
        names: set[str] = set()

        def visit(node):  # a range vector's selector is visited as a child
            if isinstance(node, promql_parser.VectorSelector) and node.name:
                names.add(node.name)

        promql_parser.walk(ast, visit)
        assert names == promql_metric_names(q), where


# --------------------------------------------------------------------------- provisioning


def test_datasource_uid_matches_the_dashboard(dashboard):
    (ds,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    (var,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert var["query"] == "prometheus" and var["current"]["value"] == ds["uid"]
    assert dashboard["uid"] == "inferline"


def test_prometheus_scrapes_the_workers():
    config = yaml.safe_load(PROMETHEUS.read_text())
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "inferline"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (sd,) = job["dns_sd_configs"]
    workers = {name for name, svc in compose.items() if name.startswith("worker")}
    assert set(sd["names"]) == workers
    for name in workers:
        assert int(compose[name]["environment"]["INFERLINE_HTTP__PORT"]) == sd["port"]
    for rule_file in config["rule_files"]:
        assert (PROMETHEUS.parent / rule_file).is_file(), rule_file


def test_alert_rules_are_complete():
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            assert re.fullmatch(r"Inferline\w+", rule["alert"])
            assert rule["labels"]["severity"] in ("critical", "warning", "info")
            assert rule["annotations"]["summary"]


def test_dashboard_provider_points_at_the_mounted_folder():
    (provider,) = yaml.safe_load(PROVIDERS.read_text())["providers"]
    grafana = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["grafana"]
    mounts = dict(
        v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"] if v.startswith("./")
    )
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
