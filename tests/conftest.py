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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`-m "not kafka"` must leave out every test that needs the broker: a test whose fixtures
    reach kafka_bootstrap without the `kafka` marker is an error, not a silent broker start."""
    unmarked = [i.nodeid for i in items if "kafka_bootstrap" in getattr(i, "fixturenames", ())
                and i.get_closest_marker("kafka") is None]
    if unmarked:
        raise pytest.UsageError("these tests use the broker but lack @pytest.mark.kafka: " + ", ".join(unmarked))
