"""instructor (PyPI) extracts a typed object through a running gateway and the real worker's
grammar engine (issue 50's done-when). instructor 1.17, its newest release, requires
`jiter<0.15` while the openai SDK the project pins needs `jiter>=0.16`: the two cannot share an
environment, so instructor runs from a virtual environment of its own (pip resolves it an older
openai SDK), as a user's application would. `make test-full` runs it (the install takes a minute
the first time); it skips, saying why, only when PyPI cannot be reached."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gateway_fixtures import shallow_fleet  # noqa: F401 - fixture
from tests.kafka.test_gateway_fields import CITIES, MODEL

pytestmark = [pytest.mark.kafka, pytest.mark.full]

INSTRUCTOR = "instructor==1.17.0"
# Mode.TOOLS: the model is made to call one function whose schema is the response model's; the
# gateway turns the named tool_choice into the grammar engine's constraint.
EXTRACT = """
import sys
from typing import Literal

import instructor
import openai
from pydantic import BaseModel


class Place(BaseModel):
    city: Literal[{cities}]
    sunny: bool


client = instructor.from_openai(
    openai.OpenAI(base_url=sys.argv[1], api_key="sk-acme", max_retries=0),
    mode=instructor.Mode.TOOLS,
)
place = client.chat.completions.create(
    model={model!r},
    response_model=Place,
    messages=[{{"role": "user", "content": "It is sunny in Paris today."}}],
    temperature=0,
    max_tokens=60,
    max_retries=0,
)
print(place.model_dump_json())
"""


@pytest.fixture(scope="module")
def instructor_python(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("instructor") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
    done = subprocess.run([*pip, INSTRUCTOR], capture_output=True, text=True, timeout=900)
    if done.returncode != 0 and "Could not find a version" in done.stderr + done.stdout:
        pytest.skip(f"{INSTRUCTOR} could not be installed from PyPI: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stdout + done.stderr
    return venv / "bin" / "python"


async def test_instructor_extracts_a_typed_object_through_the_gateway(
    shallow_fleet, instructor_python
):
    script = EXTRACT.format(cities=", ".join(repr(c) for c in CITIES), model=MODEL)
    proc = await asyncio.create_subprocess_exec(
        str(instructor_python),
        "-c",
        script,
        shallow_fleet.url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 300)  # the gateway serves meanwhile
    assert proc.returncode == 0, err.decode()[-3000:]
    place = json.loads(out.decode().strip().splitlines()[-1])
    assert place["city"] in CITIES and isinstance(place["sunny"], bool), place
