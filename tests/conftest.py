"""Suite-wide pytest set-up. Fixture plugins are listed here; add yours to `pytest_plugins`."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The folders that install as inferline.<name>.
PACKAGE_FOLDERS = ("worker", "producer", "contract", "kernels", "config")

# bench/__init__.py takes the checkout off sys.path (`python -m pytest` puts it first, and our
# kernels/ would shadow Hugging Face's `kernels`) and finds `tests`, `bench` and `scripts` by name:
# a bare `import worker` fails here as it would beside an installed wheel.
_spec = importlib.util.spec_from_file_location(
    "bench", REPO / "bench" / "__init__.py", submodule_search_locations=[str(REPO / "bench")]
)
_spec.loader.exec_module(sys.modules.setdefault("bench", importlib.util.module_from_spec(_spec)))

LOG_TAIL_LINES = 60

pytest_plugins = ["tests.kafka_fixtures", "tests.engine_fixtures", "tests.time_cap"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--chaos-long",
        action="store_true",
        default=False,
        help="run the chaos tests at full length (more kills, restarts and requests); "
        "read it with request.config.getoption('--chaos-long')",
    )
    parser.addoption(
        "--full",
        action="store_true",
        default=False,
        help="also run the tests marked `full` (exhaustive matrices, the bench scripts' smoke "
        "runs), which `make test` leaves out; `make test-full` runs everything",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The directory is the marker: tests/kafka/ holds every test that needs a broker (the shared
    one or a private one) and gets `kafka`, tests/kernels/ gets `kernels`, tests/unit/ needs
    neither. A test outside tests/kafka/ that reaches the broker is an error, not a silent start."""
    misplaced = []
    for item in items:
        room = item.path.parent.name
        if room == "kafka":
            item.add_marker(pytest.mark.kafka)
        elif room == "kernels":
            item.add_marker(pytest.mark.kernels)
        if room != "kafka" and (
            "kafka_bootstrap" in getattr(item, "fixturenames", ())
            or item.get_closest_marker("kafka") is not None
        ):
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError(
            "these tests use the broker but are not in tests/kafka/: " + ", ".join(misplaced)
        )
    if not config.getoption("--full") and "full" not in config.getoption("markexpr"):
        left_out = [item for item in items if _left_out(config, item)]
        if left_out:  # deselected, not skipped: they are not run, and the summary counts them apart
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if not _left_out(config, item)]


def _left_out(config: pytest.Config, item: pytest.Item) -> bool:
    """`full` tests stay out of `make test`; `make chaos` (--chaos-long) runs the `chaos` ones."""
    if item.get_closest_marker("full") is None:
        return False
    return not (config.getoption("--chaos-long") and item.get_closest_marker("chaos"))


# The suite's own process, not a pytester run inside it: (config, exit status).
_top: dict = {}


def pytest_configure(config: pytest.Config) -> None:
    _top.setdefault("config", config)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if session.config is _top.get("config"):
        _top["status"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Ends the suite's process with pytest's status once its report is out. A whole-suite run
    aborted in the interpreter's finalization after its summary ("terminate called without an
    active exception", exit 134: a native library's thread torn down at exit; the cause is not
    found yet, and no worker process shows it); pytest's verdict is the one to keep."""
    if config is _top.get("config") and "status" in _top:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_top["status"])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test's worker logs (*.log under its tmp_path) end its report: a subprocess's
    story is otherwise gone with the tmp dir, on CI above all."""
    report = (yield).get_result()
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and tmp is not None:
        for log in sorted(Path(tmp).glob("**/*.log"))[:6]:
            tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            report.sections.append((f"last lines of {log.relative_to(tmp)}", "\n".join(tail)))
