"""tests/time_cap.py: a test over the cap fails, a module fixture's set-up included (a session
fixture's is not); under the cap, or with the cap off, it passes; a hung test ends the run with
every thread's stack."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

SLOW = """
import time, pytest

@pytest.fixture(scope="module")
def slow_setup():
    time.sleep(0.4)

@pytest.fixture(scope="session")
def slow_session():
    time.sleep(0.4)

def test_slow_call():
    time.sleep(0.4)

def test_slow_setup(slow_setup):
    pass

def test_quick(slow_session):
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(
        "pytest_plugins = ['tests.time_cap']\n"
        "def pytest_addoption(parser):\n"
        "    parser.addoption('--chaos-long', action='store_true')\n"
        "    parser.addoption('--full', action='store_true')\n"
    )
    pytester.makepyfile(test_slow=SLOW)
    return pytester


def test_a_test_over_the_cap_fails_and_its_fixture_counts(suite):
    result = suite.runpytest_inprocess("-p", "no:cacheprovider", "--time-cap", "0.3")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["*test_slow_call took*over the suite's cap of 0 s*"])


@pytest.mark.parametrize("args", [["--time-cap", "5"], ["--time-cap", "0"], ["--full"]])
def test_under_the_cap_or_with_it_off_everything_passes(suite, args):
    suite.runpytest_inprocess("-p", "no:cacheprovider", *args).assert_outcomes(passed=3)


def test_a_hung_test_ends_the_run_with_every_threads_stack(suite, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[2]))  # `tests`, in a subprocess
    suite.makepyfile(test_hangs="import time\ndef test_hangs():\n    time.sleep(60)\n")
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", "--hang-s", "1", "test_hangs.py")
    assert result.ret == 1
    result.stderr.fnmatch_lines(["*test_hangs.py::test_hangs still runs after 1 s: hung*"])
    result.stderr.fnmatch_lines(["*in test_hangs*"])
