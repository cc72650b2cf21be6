"""Guarantee tests cannot skip silently (the hook is imported by ``tests/conftest.py``).

An end-to-end, chaos (marker ``e2e``) or clock-skew (marker ``skew``) test that skips because
something it needs is missing fails instead, with the skip's reason (which says what to
install), unless ``DRIFTSAFE_ALLOW_SKIPS=1``. A skip declared by a ``skip`` marker or a
``skipif`` marker whose condition holds is deliberate configuration and stays a skip.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

#: Markers of the tests that show a guarantee and must not skip for something missing.
GUARANTEE_MARKERS = ("e2e", "skew")
ALLOW_SKIPS = "DRIFTSAFE_ALLOW_SKIPS"


def _skipped_by_marker(item: pytest.Item) -> bool:
    """Whether a ``skip`` marker, or a ``skipif`` marker whose condition holds, skips
    ``item``: a skip decided by configuration, not by something missing."""
    if item.get_closest_marker("skip") is not None:
        return True
    for mark in item.iter_markers("skipif"):
        conditions = mark.args or (mark.kwargs.get("condition", False),)
        if any(not isinstance(c, str) and bool(c) for c in conditions):
            return True
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.skipped or os.environ.get(ALLOW_SKIPS) == "1":
        return
    if not any(item.get_closest_marker(name) for name in GUARANTEE_MARKERS):
        return
    if _skipped_by_marker(item):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (
        f"{item.nodeid} would have skipped, but it shows a guarantee and must run: "
        f"{reason.removeprefix('Skipped: ')}\n"
        "Install what it names (tests/run.sh installs and starts it when run as root), or set "
        f"{ALLOW_SKIPS}=1 to allow this skip."
    )
