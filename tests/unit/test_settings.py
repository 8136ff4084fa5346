"""The settings tree: environment names, clear errors, secrets."""

from __future__ import annotations

import pytest

from inferline.config.settings import Settings, SettingsError, load_settings


def test_defaults_match_the_contract(monkeypatch):
    # scripts/test.sh points subprocesses at its broker's port: the defaults are without it.
    monkeypatch.delenv("INFERLINE_KAFKA__BOOTSTRAP_SERVERS", raising=False)
    s = Settings()
    assert s.kafka.bootstrap_servers == "localhost:9092"
    assert (s.kafka.request_topic, s.kafka.cancel_topic, s.kafka.dlq_topic) == (
        "llm.requests",
        "llm.cancel",
        "llm.requests.dlq",
    )
    assert s.kafka.group_id == "inferline-workers"
    assert s.model.device == "auto" and s.cache.block_size == 16


def test_nested_environment_variables(monkeypatch):
    monkeypatch.setenv("INFERLINE_KAFKA__BOOTSTRAP_SERVERS", "broker:29092")
    monkeypatch.setenv("INFERLINE_SCHEDULER__MAX_NUM_SEQS", "7")
    monkeypatch.setenv("INFERLINE_HTTP__PORT", "9100")
    s = load_settings()
    assert s.kafka.bootstrap_servers == "broker:29092"
    assert s.scheduler.max_num_seqs == 7 and s.http.port == 9100


@pytest.mark.parametrize(
    "name,value",
    [
        ("INFERLINE_SCHEDULER__MAX_NUM_SEQS", "many"),
        ("INFERLINE_HTTP__PORT", "70000"),
        ("INFERLINE_CACHE__BLOCK_SIZE", "12"),
        ("INFERLINE_MODEL__DEVICE", "tpu"),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as err:
        load_settings()
    message = str(err.value.code)
    assert name in message and "\n" not in message


def test_password_from_a_file_and_never_in_repr(monkeypatch, tmp_path):
    secret = tmp_path / "pw"
    secret.write_text("s3cret-from-file\n")
    monkeypatch.setenv("INFERLINE_KAFKA__SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("INFERLINE_KAFKA__SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("INFERLINE_KAFKA__SASL_USERNAME", "alice")
    monkeypatch.setenv("INFERLINE_KAFKA__SASL_PASSWORD", "from-env")
    s = load_settings()
    assert s.kafka.connection_options()["sasl_plain_password"] == "from-env"
    assert "from-env" not in repr(s)
    monkeypatch.setenv("INFERLINE_KAFKA__SASL_PASSWORD_FILE", str(secret))
    assert load_settings().kafka.connection_options()["sasl_plain_password"] == "s3cret-from-file"


def test_client_settings_pass_through_from_json_variables(monkeypatch):
    monkeypatch.setenv("INFERLINE_KAFKA__LIBRDKAFKA", '{"socket.keepalive.enable": true}')
    monkeypatch.setenv("INFERLINE_KAFKA__AIOKAFKA", '{"request_timeout_ms": 17000}')
    k = load_settings().kafka
    assert k.librdkafka_config()["socket.keepalive.enable"] is True
    assert k.connection_options()["request_timeout_ms"] == 17000
    assert k.client_options()["request_timeout_ms"] == 17000


@pytest.mark.parametrize(
    "name,value,said",
    [
        ("INFERLINE_KAFKA__LIBRDKAFKA", '{"no.such.setting": 1}', "No such configuration property"),
        ("INFERLINE_KAFKA__LIBRDKAFKA", '{"linger.ms": "soon"}', "Invalid value"),
        ("INFERLINE_KAFKA__LIBRDKAFKA", '{"isolation.level": "read_uncommitted"}', "itself"),
        ("INFERLINE_KAFKA__AIOKAFKA", '{"fetch_max_bytes": 1}', "every aiokafka client"),
        ("INFERLINE_KAFKA__AIOKAFKA", '{"acks": 1}', "itself"),
    ],
)
def test_a_client_setting_a_library_refuses_stops_start_up_by_name(monkeypatch, name, value, said):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as err:
        load_settings()
    message = str(err.value.code)
    assert name in message and said in message and "\n" not in message
