"""The guard that keeps tests from skipping silently (``tests/skip_guard.py``), run on small
test files in a pytest process of their own (``pytester``): every way a test can skip (a
marker, ``skipif``, a skip in a fixture or the test, a skip or ``importorskip`` while the module
is collected) fails the run unless it is a declared configuration skip."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest_plugins = ["pytester"]

CONFTEST = """
import pytest

from tests.skip_guard import (  # noqa: F401
    pytest_make_collect_report,
    pytest_report_header,
    pytest_runtest_makereport,
    pytest_terminal_summary,
)


@pytest.fixture
def needs_frobnicator():
    pytest.skip("frobnicator is not installed: apt-get install frobnicator")
"""

#: One test for each way to skip; the configuration ones say so through ``configuration()``.
SAMPLE = """
import pytest

from tests.skip_guard import configuration


def test_missing_tool():
    pytest.skip("frobnicator is not installed: apt-get install frobnicator")


def test_missing_tool_in_a_fixture(needs_frobnicator):
    pass


def test_missing_module():
    pytest.importorskip("no_such_module_here")


@pytest.mark.skipif(True, reason="no redis-server on PATH")
def test_skipif_for_a_missing_tool():
    pass


@pytest.mark.skip(reason="flaky")
def test_skip_marker():
    pass


@pytest.mark.skipif(True, reason=configuration("runs on PostgreSQL only"))
def test_other_database():
    pass


def test_feature_this_database_lacks():
    pytest.skip(configuration("SQLite has no isolation levels"))


@pytest.mark.xfail(reason="a known bug", strict=True)
def test_known_bug():
    assert False


def test_runs():
    pass
"""
UNDECLARED = [
    "test_missing_tool",
    "test_missing_tool_in_a_fixture",
    "test_missing_module",
    "test_skipif_for_a_missing_tool",
    "test_skip_marker",
]

MODULE_SKIP = """
import pytest

pytest.skip("libfrob is not installed: apt-get install libfrob", allow_module_level=True)


def test_never_collected():
    pass
"""
MODULE_IMPORTORSKIP = """
import pytest

frob = pytest.importorskip("no_such_module_here", reason="pip install frob")


def test_never_collected():
    pass
"""
MODULE_CONFIGURATION = """
import pytest

from tests.skip_guard import configuration

pytest.skip(configuration("runs on the PostgreSQL pass"), allow_module_level=True)


def test_never_collected():
    pass
"""


@pytest.fixture
def sample(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """Every way to skip, in one directory: each run of it is a pytest process (seconds)."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.delenv("DRIFTSAFE_ALLOW_SKIPS", raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nxfail_strict = true\n")
    pytester.makepyfile(
        test_sample=SAMPLE,
        test_module_skip=MODULE_SKIP,
        test_module_importorskip=MODULE_IMPORTORSKIP,
        test_module_configuration=MODULE_CONFIGURATION,
    )
    return pytester


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    # (a module that fails its collection would otherwise stop the run before any test)
    return pytester.runpytest_subprocess(
        "-p", "no:django", "-p", "no:cacheprovider", "--continue-on-collection-errors", *args
    )


def test_every_undeclared_skip_fails_saying_what_to_install(sample: pytest.Pytester) -> None:
    result = run(sample, "-rs")
    # the five undeclared skips fail (those decided in set-up as errors), so do the two modules
    # skipped while collected (collection errors); the configuration skips (two tests and a
    # module) stay skips; an xfail is no skip
    result.assert_outcomes(passed=1, skipped=3, failed=2, errors=5, xfailed=1)
    for name in UNDECLARED:
        result.stdout.fnmatch_lines([f"test_sample.py::{name} would have skipped*"])
    result.stdout.fnmatch_lines(
        [
            "*test_sample.py::test_missing_tool would have skipped, but every test here must "
            "run: frobnicator is not installed: apt-get install frobnicator*",
            "*DRIFTSAFE_ALLOW_SKIPS=1*",
        ]
    )
    result.stdout.fnmatch_lines(["*could not import 'no_such_module_here'*"])
    result.stdout.fnmatch_lines(["*no redis-server on PATH*"])
    for module, reason in (
        ("test_module_skip.py", "libfrob is not installed: apt-get install libfrob"),
        ("test_module_importorskip.py", "pip install frob"),
    ):
        result.stdout.fnmatch_lines(
            [f"*{module} would have skipped all its tests while collected*{reason}*"]
        )
    result.stdout.fnmatch_lines(["*configuration: runs on the PostgreSQL pass*"])
    result.stdout.no_fnmatch_line("*DRIFTSAFE_ALLOW_SKIPS=* is set*")
    assert result.ret != 0


def test_allow_skips_lets_them_skip_and_says_so_at_the_top_and_the_end(
    sample: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DRIFTSAFE_ALLOW_SKIPS", "1")
    result = run(sample)
    result.assert_outcomes(passed=1, skipped=10, xfailed=1)
    assert result.ret == 0
    lines = result.stdout.lines
    header = next(i for i, line in enumerate(lines) if "DRIFTSAFE_ALLOW_SKIPS=1 is set" in line)
    assert header < next(i for i, line in enumerate(lines) if "collected" in line)
    result.stdout.fnmatch_lines(
        [
            "*= DRIFTSAFE_ALLOW_SKIPS=1 is set =*",
            "7 skip(s) it let through (each would have failed the run):",
        ]
    )
    for name in UNDECLARED:
        result.stdout.fnmatch_lines([f"  test_sample.py::{name}: *"])
    result.stdout.fnmatch_lines(["  test_module_skip.py: libfrob is not installed*"])
    result.stdout.fnmatch_lines(["  test_module_importorskip.py: pip install frob"])
    result.stdout.no_fnmatch_line("*test_other_database*")
    result.stdout.no_fnmatch_line("*test_module_configuration.py:*")


def test_an_allow_skips_other_than_1_is_shown_and_allows_nothing(
    sample: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DRIFTSAFE_ALLOW_SKIPS", "yes")
    result = run(sample)
    result.assert_outcomes(passed=1, skipped=3, failed=2, errors=5, xfailed=1)
    result.stdout.fnmatch_lines(
        ["*DRIFTSAFE_ALLOW_SKIPS=yes is set: no effect (only 1 has)*", "*only 1 allows skips*"]
    )
