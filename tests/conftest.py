"""Suite-wide pytest set-up. Fixture plugins are listed here; add yours to `pytest_plugins`."""
from __future__ import annotations

import pytest

pytest_plugins = ["tests.kafka_fixtures", "tests.engine_fixtures"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--chaos-long",
        action="store_true",
        default=False,
        help="run the chaos tests at full length (more kills, restarts and requests); "
        "read it with request.config.getoption('--chaos-long')",
    )
