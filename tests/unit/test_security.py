"""Security without a broker: settings never show the password, a bad setting's error does not
echo it, and static checks over the source (no pickle/marshal/eval/exec, no templates built from
a request). SASL over TLS on a broker: tests/kafka/test_security.py."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path


from inferline.config.settings import Settings

REPO = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ["worker", "producer", "config", "kernels"]


def test_settings_never_show_the_password():
    settings = Settings(
        kafka={
            "sasl_password": "hunter2-secret",
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_username": "u",
        }
    )
    for shown in (
        repr(settings),
        str(settings),
        settings.model_dump_json(),
        repr(settings.kafka),
        str(settings.model_dump()),
    ):
        assert "hunter2-secret" not in shown
    assert settings.kafka.sasl_password.get_secret_value() == "hunter2-secret"


def test_a_bad_setting_error_does_not_echo_the_password():
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("INFERLINE_")},
        "INFERLINE_KAFKA__SASL_PASSWORD": "hunter2-secret",
        "INFERLINE_KAFKA__SECURITY_PROTOCOL": "BOGUS",
    }
    done = subprocess.run(
        [sys.executable, "-P", "-m", "inferline.worker"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "INFERLINE_KAFKA__SECURITY_PROTOCOL" in done.stderr
    assert "hunter2-secret" not in done.stdout + done.stderr


# ------------------------------------------------------------------------------ static checks

FORBIDDEN_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "marshal",
    "shelve",
    "dill",
    "cloudpickle",
    "jsonpickle",
    "jinja2",
    "mako",
    "string.Template",
}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__", "execfile", "input"}


def python_sources():
    for folder in SOURCE_DIRS:
        yield from sorted((REPO / folder).rglob("*.py"))


def keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def test_no_pickle_no_eval_no_templates_from_requests():
    problems = []
    for path in python_sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        where = lambda node: f"{path.relative_to(REPO)}:{node.lineno}"  # noqa: E731
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                problems += [
                    f"{where(node)} imports {a.name}"
                    for a in node.names
                    if a.name.split(".")[0] in FORBIDDEN_MODULES
                ]
            elif isinstance(node, ast.ImportFrom) and node.module:
                if node.module.split(".")[0] in FORBIDDEN_MODULES:
                    problems.append(f"{where(node)} imports from {node.module}")
                if node.module == "string" and any(a.name == "Template" for a in node.names):
                    problems.append(f"{where(node)} imports string.Template")
            elif isinstance(node, ast.Call):
                fn = node.func
                name = (
                    fn.id
                    if isinstance(fn, ast.Name)
                    else fn.attr
                    if isinstance(fn, ast.Attribute)
                    else ""
                )
                if isinstance(fn, ast.Name) and name in FORBIDDEN_CALLS:
                    problems.append(f"{where(node)} calls {name}()")
                if name in ("system", "popen") or keyword(node, "shell") is not None:
                    problems.append(f"{where(node)} runs a shell")
                if (
                    name == "load"
                    and isinstance(fn, ast.Attribute)
                    and getattr(fn.value, "id", "") == "torch"
                ):
                    wo = keyword(node, "weights_only")
                    if not (isinstance(wo, ast.Constant) and wo.value is True):
                        problems.append(f"{where(node)} torch.load without weights_only=True")
                if name in ("load", "unsafe_load") and getattr(fn.value, "id", "") == "yaml":
                    problems.append(f"{where(node)} yaml.{name}")
                tr = keyword(node, "trust_remote_code")
                if tr is not None and not (isinstance(tr, ast.Constant) and tr.value is False):
                    problems.append(f"{where(node)} trust_remote_code")
                # The chat template is the model's own: never one passed in (from a request).
                if name == "apply_chat_template" and keyword(node, "chat_template") is not None:
                    problems.append(
                        f"{where(node)} apply_chat_template with a chat_template argument"
                    )
                if name in ("format_map", "from_string", "Template", "Environment"):
                    problems.append(f"{where(node)} builds a template ({name})")
                if name in ("unpackb", "Unpacker") and (
                    keyword(node, "ext_hook") or keyword(node, "object_hook")
                ):
                    problems.append(f"{where(node)} msgpack hooks turn data into objects")
    assert not problems, "\n".join(problems)


def test_request_text_is_data_in_the_chat_template():
    """Template syntax in a message is rendered as text, not evaluated."""
    from inferline.worker.engine.models.loader import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir())
    payload = "{{ 7*7 }}{% for x in range(3) %}X{% endfor %}{{ ''.__class__ }}"
    ids = tok.apply_chat_template(
        [{"role": "user", "content": payload}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    text = tok.decode(ids)
    assert payload in text and "49" not in text.replace(payload, "")
