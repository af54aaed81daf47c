"""A pytest plugin for the GPU check's ``suite`` step (``-p benchmarks.pytest_failure_log``): with
``AQSGD_TEST_LOG=<file>``, each test that fails or errs is appended to that file as it happens, one line:
where it failed (SETUP, CALL, TEARDOWN), the test, its error's lines joined by `` | `` (the first 1,500
characters: a message whose first line says only "rank 0:" still says why). A run cut short by a time
limit still says what failed, where pytest's own summary comes only at the end. Under pytest-xdist the
controller writes it (the workers' reports reach it).

With ``AQSGD_TEST_REVERSE=1`` the tests run in reverse collection order (every xdist worker reverses the same
collection, and the scheduler hands out its items in that order): the GPU check's second call reaches first
the tests that the first call's time limit cut off."""

from __future__ import annotations

import os


def pytest_collection_modifyitems(session, config, items) -> None:
    if os.environ.get("AQSGD_TEST_REVERSE") == "1":
        items.reverse()


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("AQSGD_TEST_LOG")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(report.longrepr)
    lines = " | ".join(line.strip() for line in message.splitlines() if line.strip())
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{report.when.upper()} {report.nodeid}: {lines[:1500]}\n")
