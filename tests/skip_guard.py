"""No test skips silently (the hooks are imported by ``tests/conftest.py``).

Every test here shows something the package promises, so a skip is a failure unless it is a
*declared configuration skip*: one whose reason was made by :func:`configuration` (a test for
another database than this pass's, a database feature this one lacks). Any other skip, say for
a missing ``redis-server``, ``openssl``, libfaketime, RabbitMQ, a browser or root, fails the
run with the skip's reason (which says what to install), whichever way it skipped:

* a ``skip`` or ``skipif`` marker (on the test, its class or its module);
* ``pytest.skip()`` or ``pytest.importorskip()`` in a fixture or the test;
* ``pytest.skip(allow_module_level=True)`` or ``pytest.importorskip()`` while the module is
  collected (its tests never appear: the collection fails instead).

``DRIFTSAFE_ALLOW_SKIPS=1`` lets such skips through (to run part of the suite on a machine
that lacks something). It is never silent: the run's header says it is set, and its summary
lists the skips it let through.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

ALLOW_SKIPS = "DRIFTSAFE_ALLOW_SKIPS"
#: The start of every declared configuration skip's reason.
TAG = "configuration: "
_HINT = (
    "Install what it names (`bash tests/services.sh --install` installs every Debian package "
    f"the suite uses), or set {ALLOW_SKIPS}=1 to allow this skip."
)


def configuration(reason: str) -> str:
    """The reason of a declared configuration skip, for ``pytest.skip()`` or a ``skipif``
    marker: the test does not apply to this pass (another database, a feature this database
    lacks). Never for something missing from the machine."""
    return TAG + reason


def _allowed() -> bool:
    return os.environ.get(ALLOW_SKIPS) == "1"


def _reason(longrepr: Any) -> str:
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return str(text).removeprefix("Skipped: ")


def _undeclared(report: pytest.TestReport | pytest.CollectReport) -> bool:
    return report.skipped and not _reason(report.longrepr).startswith(TAG)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    """A test that skipped (a marker, or a skip in a fixture or the test) fails instead."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if _allowed() or not _undeclared(report) or hasattr(report, "wasxfail"):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"{item.nodeid} would have skipped, but every test here must run: "
        f"{_reason(report.longrepr)}\n{_HINT}"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    """A module that skipped while it was collected fails its collection instead."""
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if _allowed() or not _undeclared(report):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"{collector.nodeid} would have skipped all its tests while collected, but every test "
        f"here must run: {_reason(report.longrepr)}\n{_HINT}"
    )


def pytest_report_header(config: pytest.Config) -> str | None:
    if ALLOW_SKIPS not in os.environ:
        return None
    value = os.environ[ALLOW_SKIPS]
    effect = "tests may skip for what is missing" if value == "1" else "no effect (only 1 has)"
    return f"{ALLOW_SKIPS}={value} is set: {effect}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if ALLOW_SKIPS not in os.environ:
        return
    value = os.environ[ALLOW_SKIPS]
    let_through = [
        f"  {report.nodeid}: {_reason(report.longrepr)}"
        for report in terminalreporter.stats.get("skipped", [])
        if _undeclared(report)
    ]
    terminalreporter.write_sep("=", f"{ALLOW_SKIPS}={value} is set")
    if value != "1":
        terminalreporter.write_line("it has no effect: only 1 allows skips")
        return
    terminalreporter.write_line(
        f"{len(let_through)} skip(s) it let through (each would have failed the run):"
    )
    for line in let_through:
        terminalreporter.write_line(line)
