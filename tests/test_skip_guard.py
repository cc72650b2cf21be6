"""The guard that keeps guarantee tests from skipping silently (``tests/skip_guard.py``),
run on small test files in a pytest process of their own (``pytester``)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest_plugins = ["pytester"]

SAMPLE = """
import pytest

pytestmark = pytest.mark.{marker}


def test_missing_tool():
    pytest.skip("frobnicator is not installed: apt-get install frobnicator")


@pytest.mark.skipif(True, reason="runs on PostgreSQL only")
def test_other_database():
    pass


@pytest.mark.skip(reason="slow: run with --run-slow")
def test_soak():
    pass


def test_runs():
    pass
"""


@pytest.fixture
def sample(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeconftest("from tests.skip_guard import pytest_runtest_makereport  # noqa\n")
    pytester.makeini("[pytest]\nmarkers =\n    e2e: e2e\n    skew: skew\n    other: other\n")
    for marker in ("e2e", "skew", "other"):
        pytester.makepyfile(**{f"test_{marker}": SAMPLE.format(marker=marker)})
    return pytester


def test_missing_dependency_fails_guarantee_tests_and_says_what_to_install(
    sample: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DRIFTSAFE_ALLOW_SKIPS", raising=False)
    result = sample.runpytest_subprocess("-p", "no:django", "-rs")
    # e2e and skew: the runtime skip fails; the two marker skips stay skips; "other" may skip
    result.assert_outcomes(passed=3, skipped=7, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*test_e2e.py::test_missing_tool would have skipped, but it shows a guarantee*"
            "frobnicator is not installed: apt-get install frobnicator*",
            "*DRIFTSAFE_ALLOW_SKIPS=1*",
        ]
    )
    assert result.ret != 0


def test_allow_skips_lets_them_skip(
    sample: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DRIFTSAFE_ALLOW_SKIPS", "1")
    result = sample.runpytest_subprocess("-p", "no:django")
    result.assert_outcomes(passed=3, skipped=9)
    assert result.ret == 0
