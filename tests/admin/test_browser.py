"""End to end in a real browser, at a laptop's 1366 by 768: headless Chromium logs into the admin
on a live server, adds a crontab task through the form that asks for the schedule kind first,
reads the task list without scrolling sideways, and runs the task now.

Needs Debian's ``chromium`` and ``chromium-driver`` (``apt-get install -y chromium
chromium-driver``) and Selenium from PyPI; Selenium is pointed at ``/usr/bin/chromedriver`` and
never downloads a driver. With ``DRIFTSAFE_SCREENSHOTS=1`` the test also writes the screenshots
of each admin page used by the docs to ``docs/screenshots/``.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import django.contrib.admin
import pytest
from django.test import override_settings

import celery_driftsafe
from celery_driftsafe.admin.display import local_text
from celery_driftsafe.definitions import changes
from celery_driftsafe.models import PeriodicTask, Run, RunKind, RunStatus
from tests.support import drain
from tests.support.cluster_data import beat_node
from tests.support.factories import crontab_task, interval_task, solar_task

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
ADMIN_STATIC = Path(django.contrib.admin.__file__).resolve().parent / "static" / "admin"
PACKAGE_STATIC = Path(celery_driftsafe.__file__).resolve().parent / "static" / "celery_driftsafe"
#: A laptop's screen: the admin must be readable here without scrolling sideways.
WIDTH, HEIGHT = 1366, 768

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="session")
def _admin_static(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """STATIC_URL must be set when the live server starts (its static handler reads it then)
    and STATIC_ROOT lets it serve the admin's CSS and JavaScript and the package's own (the
    task form's script), gathered as ``collectstatic`` would, so the pages and screenshots
    look as in a project with staticfiles."""
    root = tmp_path_factory.mktemp("static")
    (root / "admin").symlink_to(ADMIN_STATIC, target_is_directory=True)
    (root / "celery_driftsafe").symlink_to(PACKAGE_STATIC, target_is_directory=True)
    with override_settings(STATIC_URL="/static/", STATIC_ROOT=str(root)):
        yield


@pytest.fixture(scope="session")
def live_server(_admin_static: None, live_server: Any) -> Any:
    """pytest-django's live server, started after :func:`_admin_static`."""
    return live_server


@pytest.fixture
def browser() -> Iterator[Any]:
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="Selenium is not installed (pip install selenium)"
    )
    for binary, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not shutil.which(binary):
            pytest.skip(
                f"{binary} not found: install Debian's {package} "
                "(apt-get install -y chromium chromium-driver)"
            )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={WIDTH},{HEIGHT}",
        "--lang=en-GB",
    ):
        options.add_argument(argument)
    # the browser in the admin's zone (the tests' TIME_ZONE), so the date/time widgets do not
    # add "Note: You are 1 hour behind server time." to the forms and their screenshots
    service = webdriver.ChromeService(
        executable_path=CHROMEDRIVER, env={**os.environ, "TZ": "Europe/Berlin"}
    )
    driver = webdriver.Chrome(options=options, service=service)
    driver.implicitly_wait(5)
    yield driver
    driver.quit()


def _click_and_wait(driver: Any, element: Any) -> None:
    """Click something that loads a new page, and wait until the new page has replaced the
    old one (a click returns before the navigation is done)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    page = driver.find_element(By.TAG_NAME, "html")
    element.click()
    WebDriverWait(driver, 15).until(expected_conditions.staleness_of(page))


def _shoot(driver: Any, name: str, tmp_path: Path) -> None:
    """Save a full-page screenshot (to docs/screenshots with DRIFTSAFE_SCREENSHOTS=1)."""
    height, chrome = driver.execute_script(
        "return [document.documentElement.scrollHeight, window.outerHeight - window.innerHeight]"
    )
    # the window's size includes the browser's own bars: add them to the page's height
    driver.set_window_size(WIDTH, max(HEIGHT, min(int(height) + int(chrome) + 40, 3600)))
    target = SCREENSHOTS if os.environ.get("DRIFTSAFE_SCREENSHOTS") else tmp_path
    target.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(target / f"{name}.png"))
    driver.set_window_size(WIDTH, HEIGHT)


def _nodes() -> None:
    """Beat nodes as operators see them: three heard from a few seconds ago (one with its
    clock over the allowed offset), one dead for minutes. Made just before their page is
    read: made at the test's start, on a loaded machine whose test took over 30 s (the
    dead-after), all four were dead by then."""
    now = changes.authority_now()
    for host, pid, offset, age in (
        ("beat-a", 4101, 0.0031, 1.2),
        ("beat-b", 4102, 0.712, 2.5),
        ("beat-c", 4103, -1.284, 3.1),
        ("beat-d", 3999, 0.002, 420),
    ):
        beat_node(now, host, pid, offset, age)


def _history() -> None:
    """Some runs, so the list pages show what operators see in production."""
    now = changes.authority_now()
    task = interval_task(  # with bounds and limits, for the list's column
        "cleanup-sessions",
        300,
        anchor=now - timedelta(hours=2),
        task="tests.add",
        valid_until=(now + timedelta(days=30)).replace(hour=0, minute=0, second=0, microsecond=0),
        max_runs=1000,
        run_count=6,
        jitter_seconds=2.0,
    )
    statuses = [RunStatus.SUCCEEDED] * 5 + [RunStatus.FAILED, RunStatus.MISSED]
    for i, status in enumerate(statuses):
        slot = now - timedelta(minutes=5 * (i + 1))
        late = (
            timedelta(milliseconds=3 + 11 * i)
            if status != RunStatus.MISSED
            else timedelta(minutes=3)
        )
        Run.objects.create(
            periodic_task=task,
            task_name=task.task,
            kind=RunKind.SCHEDULED,
            slot=slot,
            status=status,
            claimed_by=f"beat-{'abc'[i % 3]}:{4101 + i % 3}:5f2a",
            claimed_at=slot + late,
            dispatched_at=slot + late + timedelta(milliseconds=2),
            started_at=slot + late + timedelta(milliseconds=9)
            if status != RunStatus.MISSED
            else None,
            finished_at=slot + late + timedelta(milliseconds=900 + 70 * i)
            if status != RunStatus.MISSED
            else None,
            celery_task_id=f"00000000-0000-4000-8000-00000000000{i}",
            error="ConnectionError: upstream refused" if status == RunStatus.FAILED else "",
        )


#: The inputs of each schedule kind on the task form.
KIND_INPUTS = {
    "interval": ("interval_every", "interval_unit"),
    "crontab": ("crontab_minute", "crontab_hour", "crontab_day_of_week", "timezone"),
    "one_off": ("one_off_at_0", "one_off_at_1"),
    "solar": ("solar_event", "solar_latitude", "solar_longitude"),
}


def _shown_kinds(driver: Any) -> set[str]:
    """The kinds whose inputs are displayed, each all of them or none (else it fails)."""
    from selenium.webdriver.common.by import By

    shown = set()
    for kind, names in KIND_INPUTS.items():
        displayed = {driver.find_element(By.NAME, name).is_displayed() for name in names}
        assert len(displayed) == 1, (kind, "some of its inputs shown, some not")
        if displayed == {True}:
            shown.add(kind)
    return shown


def _more_tasks() -> None:
    """A list as a team has it: tasks of every kind, some with long names and schedules."""
    now = changes.authority_now()
    crontab_task("send-weekly-newsletter-to-subscribers", "30 7 * * 1", "Europe/Berlin")
    crontab_task("rebuild-search-index", "*/20 8-18 * * 1-5", "America/New_York")
    interval_task("poll-payment-provider-webhooks", 45, anchor=now - timedelta(hours=1))
    solar_task("close-greenhouse-shutters", "sunset", 52.52, 13.405)


@override_settings(TIME_ZONE="Europe/Berlin")
def test_admin_add_crontab_task_see_next_slot_and_run_it_now(
    browser: Any, live_server: Any, admin_user: Any, app: Any, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    _history()
    _more_tasks()
    base = live_server.url
    browser.get(f"{base}/admin/login/?next=/admin/celery_driftsafe/periodictask/")
    browser.find_element(By.NAME, "username").send_keys("admin")
    browser.find_element(By.NAME, "password").send_keys("password")
    _click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, "input[type=submit]"))
    assert "Select periodic task to change" in browser.title
    assert browser.execute_script("return window.innerWidth") == WIDTH

    # the add form asks for the kind first: none chosen, no kind's inputs shown or filled in
    browser.get(f"{base}/admin/celery_driftsafe/periodictask/add/")
    radios = browser.find_elements(By.CSS_SELECTOR, "input[name=schedule_kind]")
    assert [radio.get_attribute("value") for radio in radios] == list(KIND_INPUTS)
    assert not any(radio.is_selected() for radio in radios)
    assert _shown_kinds(browser) == set()
    _shoot(browser, "task-add", tmp_path)
    for radio in radios:  # each kind shows its own inputs only
        radio.click()
        assert _shown_kinds(browser) == {radio.get_attribute("value")}
    for name in ("crontab_minute", "crontab_hour", "crontab_second", "interval_every"):
        assert browser.find_element(By.NAME, name).get_attribute("value") == "", name

    # an invalid crontab is refused on its field
    browser.find_element(By.NAME, "name").send_keys("nightly-report")
    browser.find_element(By.NAME, "task").send_keys("tests.add")
    arguments = browser.find_element(By.NAME, "args")  # add(x, y)
    arguments.clear()
    arguments.send_keys("[1, 2]")
    browser.find_element(By.CSS_SELECTOR, "input[name=schedule_kind][value=crontab]").click()
    for name, value in (
        ("crontab_minute", "75"),
        ("crontab_hour", "3"),
        ("crontab_day_of_month", "*"),
        ("crontab_month_of_year", "*"),
        ("crontab_day_of_week", "*"),
    ):
        field = browser.find_element(By.NAME, name)
        field.clear()
        field.send_keys(value)
    zone = browser.find_element(By.NAME, "timezone")
    zone.clear()
    zone.send_keys("Europe/Berlin")
    _click_and_wait(browser, browser.find_element(By.NAME, "_save"))
    error = browser.find_element(By.CSS_SELECTOR, ".field-crontab_minute .errorlist")
    assert "75 is out of range 0-59" in error.text
    # shown again on the kind chosen, with its inputs only
    assert browser.find_element(
        By.CSS_SELECTOR, "input[name=schedule_kind][value=crontab]"
    ).is_selected()
    assert _shown_kinds(browser) == {"crontab"}
    _shoot(browser, "task-form-errors", tmp_path)

    # fixed, it is saved and its next slot is computed once, from the authority's clock
    minute = browser.find_element(By.NAME, "crontab_minute")
    minute.clear()
    minute.send_keys("15")
    _click_and_wait(browser, browser.find_element(By.NAME, "_save"))
    assert "was added successfully" in browser.find_element(By.CSS_SELECTOR, ".messagelist").text
    task = PeriodicTask.objects.get(name="nightly-report")
    assert task.next_slot_at is not None
    row = browser.find_element(By.XPATH, "//tr[.//a[text()='nightly-report']]")
    assert local_text(task.next_slot_at) in row.text  # in the admin's zone, Europe/Berlin
    assert "At 03:15 (Europe/Berlin)" in row.text
    assert "Times in Europe/Berlin" in browser.find_element(By.ID, "content").text
    # the list fits the screen: no sideways scrolling, and every column in view
    table, box = browser.execute_script(
        "const box = document.querySelector('#changelist .results');"
        "return [box.scrollWidth, box.clientWidth];"
    )
    assert table <= box, f"the task list is {table} px wide in a {box} px box"
    assert PeriodicTask.objects.count() == 6
    edge = browser.find_element(By.CSS_SELECTOR, "#changelist .results").rect
    for column in ("name", "schedule_text", "enabled", "next_slot", "last_run"):
        header = browser.find_element(By.CSS_SELECTOR, f"#result_list th.column-{column}")
        assert header.is_displayed(), column
        assert header.rect["x"] + header.rect["width"] <= edge["x"] + edge["width"] + 1, column
    _shoot(browser, "task-list", tmp_path)

    # run it now: one manual run in the ledger, one message on the broker (on a queue of this
    # test's own, so concurrent runs on the same Redis cannot mix theirs in)
    queue = f"driftsafe-browser-{uuid.uuid4().hex[:8]}"
    PeriodicTask.objects.filter(pk=task.pk).update(queue=queue)
    row.find_element(By.CSS_SELECTOR, "input.action-select").click()
    Select(browser.find_element(By.NAME, "action")).select_by_value("run_now")
    _click_and_wait(browser, browser.find_element(By.NAME, "index"))
    assert "dispatched" in browser.find_element(By.CSS_SELECTOR, ".messagelist").text
    run = Run.objects.get(kind=RunKind.MANUAL)
    assert run.periodic_task_id == task.pk and run.status == RunStatus.DISPATCHED
    assert [m["id"] for m in drain(queue)] == [run.celery_task_id]
    assert PeriodicTask.objects.get(pk=task.pk).next_slot_at == task.next_slot_at

    browser.get(f"{base}/admin/celery_driftsafe/periodictask/{task.pk}/change/")
    _shoot(browser, "task-form", tmp_path)
    # "Run now" from the task's page: a second manual run, and both in the task's history.
    _click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, ".driftsafe-run-now button"))
    assert "dispatched" in browser.find_element(By.CSS_SELECTOR, ".messagelist").text
    second = Run.objects.filter(kind=RunKind.MANUAL).exclude(pk=run.pk).get()
    assert [m["id"] for m in drain(queue)] == [second.celery_task_id]
    browser.get(f"{base}/admin/celery_driftsafe/periodictask/{task.pk}/history/")
    history = browser.find_element(By.ID, "change-history").text
    assert f"run #{run.pk}" in history and f"run #{second.pk}" in history
    browser.get(f"{base}/admin/celery_driftsafe/run/")
    assert f"#{run.pk}" in browser.find_element(By.ID, "result_list").text
    _shoot(browser, "run-list", tmp_path)
    _nodes()
    browser.get(f"{base}/admin/celery_driftsafe/beatnode/")
    assert len(browser.find_elements(By.CSS_SELECTOR, ".driftsafe-offset-exceeded")) == 1
    assert len(browser.find_elements(By.CSS_SELECTOR, ".driftsafe-node-dead")) == 1
    _shoot(browser, "node-list", tmp_path)


@override_settings(TIME_ZONE="Europe/Berlin")
def test_cluster_dashboard_in_a_real_browser(
    browser: Any, live_server: Any, admin_user: Any, tmp_path: Path
) -> None:
    """An hour of three beats (and one that died): the dashboard is reached from the app
    index, draws every run of the hour in the timeline, and is screenshotted for the docs."""
    from selenium.webdriver.common.by import By

    from tests.support.cluster_data import seed_cluster

    seeded = seed_cluster(changes.authority_now())
    base = live_server.url
    browser.get(f"{base}/admin/login/?next=/admin/celery_driftsafe/")
    browser.find_element(By.NAME, "username").send_keys("admin")
    browser.find_element(By.NAME, "password").send_keys("password")
    _click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, "input[type=submit]"))
    _click_and_wait(browser, browser.find_element(By.LINK_TEXT, "Cluster dashboard"))
    assert "Cluster dashboard" in browser.title
    browser.refresh()  # laid out at the full width from the start (the screenshot's height)
    nodes = browser.find_elements(By.CSS_SELECTOR, "#ds-nodes tr.ds-node")
    assert [row.find_element(By.TAG_NAME, "a").text for row in nodes] == [
        "beat-a:4101",
        "beat-b:4102",
        "beat-c:4103",
        "beat-d:3999",
    ]
    assert len(browser.find_elements(By.CSS_SELECTOR, ".ds-offset.ds-exceeded")) == 1
    marks = browser.find_elements(By.CSS_SELECTOR, "#ds-timeline .ds-mark")
    assert len(marks) == len(seeded.runs)
    # every mark is drawn inside the timeline's box, and the chart is actually laid out
    box = browser.find_element(By.ID, "ds-timeline").rect
    assert box["width"] > 800 and box["height"] > 100
    for mark in marks[:: max(len(marks) // 20, 1)]:
        rect = mark.rect
        assert box["x"] <= rect["x"] <= box["x"] + box["width"]
        assert box["y"] <= rect["y"] <= box["y"] + box["height"]
    bars = browser.find_elements(By.CSS_SELECTOR, "#ds-histogram rect.ds-hbar")
    assert len(bars) == 11 and max(bar.rect["height"] for bar in bars) > 50
    upcoming = browser.find_element(By.ID, "ds-next").text
    assert "refresh-cache" in upcoming and "nightly-report" in upcoming
    _shoot(browser, "cluster-dashboard", tmp_path)
    # the node list links here too
    browser.get(f"{base}/admin/celery_driftsafe/beatnode/")
    _click_and_wait(browser, browser.find_element(By.ID, "driftsafe-dashboard-link"))
    assert "Cluster dashboard" in browser.title


@override_settings(TIME_ZONE="Europe/Berlin")
def test_admin_preview_the_next_slots_before_saving(
    browser: Any, live_server: Any, admin_user: Any, app: Any, tmp_path: Path
) -> None:
    """The form's "Preview the next slots" button, a plain submit: the slots of the values as
    typed, across Berlin's spring change, and nothing saved until "Save"."""
    from selenium.webdriver.common.by import By

    from celery_driftsafe.testing import FakeClock, inject_authority_clock

    base = live_server.url
    # The live server's thread reads the injected authority too: two days before the change.
    with inject_authority_clock(FakeClock(datetime(2026, 3, 27, 12, 0, tzinfo=UTC))):
        browser.get(f"{base}/admin/login/?next=/admin/celery_driftsafe/periodictask/add/")
        browser.find_element(By.NAME, "username").send_keys("admin")
        browser.find_element(By.NAME, "password").send_keys("password")
        _click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, "input[type=submit]"))
        browser.find_element(By.NAME, "name").send_keys("nightly-report")
        browser.find_element(By.NAME, "task").send_keys("tests.add")
        arguments = browser.find_element(By.NAME, "args")  # add(x, y)
        arguments.clear()
        arguments.send_keys("[1, 2]")
        browser.find_element(By.CSS_SELECTOR, "input[name=schedule_kind][value=crontab]").click()
        for name, value in (
            ("crontab_minute", "30"),
            ("crontab_hour", "2"),
            ("crontab_day_of_month", "*"),
            ("crontab_month_of_year", "*"),
            ("crontab_day_of_week", "*"),
            ("timezone", "Europe/Berlin"),
            ("jitter_seconds", "20"),
        ):
            field = browser.find_element(By.NAME, name)
            field.clear()
            field.send_keys(value)
        _click_and_wait(browser, browser.find_element(By.NAME, "_driftsafe_preview"))
        assert not PeriodicTask.objects.exists()
        table = browser.find_element(By.ID, "driftsafe-preview")
        rows = table.find_elements(By.CSS_SELECTOR, "tr.driftsafe-slot")
        assert len(rows) == 10
        assert "2026-03-28 02:30:00 +01:00" in rows[0].text
        assert "2026-03-29 03:00:00 +02:00" in rows[1].text
        assert "UTC offset +01:00 → +02:00" in rows[1].text
        assert browser.find_element(By.NAME, "crontab_minute").get_attribute("value") == "30"
        _shoot(browser, "task-form-preview", tmp_path)
        _click_and_wait(browser, browser.find_element(By.NAME, "_save"))
        assert (
            "was added successfully" in browser.find_element(By.CSS_SELECTOR, ".messagelist").text
        )
        task = PeriodicTask.objects.get(name="nightly-report")
        assert task.next_slot_at == datetime(2026, 3, 28, 1, 30, tzinfo=UTC)
