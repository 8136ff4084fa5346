"""The suite's time budget, per test: in `make test` a test whose set-up, call and tear-down take
more than --time-cap seconds (120 by default) fails, saying so. A module fixture counts toward the
first test that sets it up; session fixtures (the broker, the loaded model, HF's reference
outputs) are the suite's, not a test's, and do not count. Off for the long forms (`make chaos`'s
--chaos-long, --full). A test still running after --hang-s is taken as hung: every thread's
stack is printed and the run exits, so a deadlock fails with its cause instead of a CI timeout."""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

import pytest

DEFAULT_CAP_S = 120.0
HANG_S = 600.0  # make test's: five caps
HANG_LONG_FORMS_S = 3600.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--time-cap",
        type=float,
        default=None,
        metavar="S",
        help=f"fail a test that takes more than S seconds in all (default "
        f"{DEFAULT_CAP_S:.0f}; 0 turns it off; off with --chaos-long or --full)",
    )
    parser.addoption(
        "--hang-s",
        type=float,
        default=None,
        metavar="S",
        help=f"a test still running after S seconds is hung: print every thread's stack and "
        f"exit 1 (default {HANG_S:.0f}, {HANG_LONG_FORMS_S:.0f} for the long forms)",
    )


def time_cap(config: pytest.Config) -> float:
    cap = config.getoption("--time-cap")
    if cap is not None:
        return cap
    long_forms = config.getoption("--chaos-long", False) or config.getoption("--full", False)
    return 0.0 if long_forms else DEFAULT_CAP_S


_session_setup_s = 0.0  # session fixtures set up since the last report


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    global _session_setup_s
    start = time.perf_counter()
    yield
    if fixturedef.scope == "session":
        _session_setup_s += time.perf_counter() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    hang_s = item.config.getoption("--hang-s") or (
        HANG_S if time_cap(item.config) else HANG_LONG_FORMS_S
    )
    watchdog = threading.Timer(hang_s, _hung, (item, hang_s))
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()


def _hung(item: pytest.Item, hang_s: float) -> None:
    """On the watchdog's thread: out of pytest's capture, every thread's stack, then exit."""
    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)
    print(f"\ntime_cap: {item.nodeid} still runs after {hang_s:.0f} s: hung", file=sys.stderr)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    global _session_setup_s
    outcome = yield
    report = outcome.get_result()
    spent = getattr(item, "_time_cap_spent", 0.0) + call.duration - _session_setup_s
    _session_setup_s = 0.0
    item._time_cap_spent = spent
    cap = time_cap(item.config)
    already = getattr(item, "_time_cap_failed", False)
    if (
        cap
        and spent > cap
        and not already
        and report.when in ("call", "teardown")
        and report.passed
    ):
        item._time_cap_failed = True
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {spent:.1f} s (set-up, call and tear-down so far), "
            f"over the suite's cap of {cap:.0f} s a test (tests/time_cap.py)"
        )
