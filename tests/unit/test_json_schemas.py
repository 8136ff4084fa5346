"""docs/schemas/*.schema.json, the JSON Schema of each message (scripts/gen_json_schemas.py), stay
true to the code: the checked-in files are what the generator writes now (none missing, none left
over), each is a valid draft-07 schema that stands alone, the examples and the JSON the real
encoders write validate, and a request file and decode_request (JSON) accept and reject the same
requests."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from inferline.contract import schema
from tests.unit.test_asyncapi import BASE, REQUEST_CASES, decodes, generator, minimal_events
from tests.unit.test_docs import load_script

REPO = Path(__file__).resolve().parents[2]
FOLDER = REPO / "docs" / "schemas"


@pytest.fixture(scope="module")
def gen():
    return load_script("gen_json_schemas")


def validator(name: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(json.loads((FOLDER / name).read_text()))


def test_the_files_are_what_the_generator_writes(gen):
    from scripts.generated import stale_files

    files = gen.render()
    assert sorted(files) == sorted(generator().JSON_SCHEMA_FILES.values())
    assert stale_files(FOLDER, files, "*.schema.json") == [], (
        "stale: run python scripts/gen_json_schemas.py"
    )


def test_a_stale_missing_or_left_over_file_is_caught(gen, tmp_path):
    from scripts.generated import stale_files

    files = gen.render()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert stale_files(tmp_path, files, "*.schema.json") == []
    (tmp_path / "done.schema.json").write_text("{}")
    (tmp_path / "cancel.schema.json").unlink()
    (tmp_path / "old.schema.json").write_text("{}")
    assert stale_files(tmp_path, files, "*.schema.json") == [
        "cancel.schema.json",
        "done.schema.json",
        "old.schema.json",
    ]


@pytest.mark.parametrize("name", sorted(p.name for p in FOLDER.glob("*.schema.json")))
def test_each_file_is_a_draft_7_schema_that_stands_alone(name):
    text = (FOLDER / name).read_text()
    jsonschema.Draft7Validator.check_schema(json.loads(text))
    assert "#/components/" not in text  # every reference resolves within the file


def test_examples_and_what_the_encoders_write_validate():
    gen_asyncapi = generator()
    files = gen_asyncapi.JSON_SCHEMA_FILES
    decoders = {"Request": schema.decode_request, "Cancel": schema.decode_cancel}
    examples = {
        "Request": gen_asyncapi.REQUEST_EXAMPLES,
        "Cancel": gen_asyncapi.CANCEL_EXAMPLES,
        **gen_asyncapi.EVENT_EXAMPLES,
    }
    for name, cases in examples.items():
        for example in cases:
            validator(files[name]).validate(example["payload"])
            decoder = decoders.get(name, schema.decode_event)
            assert decodes(decoder, example["payload"], schema.JSON), example["name"]
    for event in minimal_events():
        written = json.loads(schema.encode_event(event, schema.JSON))
        validator(files[type(event).__name__]).validate(written)
    req = schema.Request(id="r-1", reply_topic="t", prompt="p", created_at=1767225600.0)
    validator("request.schema.json").validate(json.loads(schema.encode_request(req, schema.JSON)))
    cancel = schema.encode_cancel(schema.Cancel(id="r-1"), schema.JSON)
    validator("cancel.schema.json").validate(json.loads(cancel))


@pytest.mark.parametrize(
    "change, valid", REQUEST_CASES, ids=[json.dumps(c)[:40] for c, _ in REQUEST_CASES]
)
def test_the_request_schema_and_the_json_decoder_agree(change, valid):
    payload = {**BASE, **change}
    assert validator("request.schema.json").is_valid(payload) == valid
    assert decodes(schema.decode_request, payload, schema.JSON) == valid
