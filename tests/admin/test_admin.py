"""The admin through Django's test client: the task form's validation, every action, and every
list page (contents, filters, and a bounded number of queries with thousands of runs)."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from django.conf import settings
from django.test import override_settings
from django.urls import reverse

from celery_driftsafe import celery_app
from celery_driftsafe.claim.outbox import celery_task_id
from celery_driftsafe.core.headers import HEADER_RUN_ID, HEADER_SLOT
from celery_driftsafe.core.schedules import Crontab, Solar
from celery_driftsafe.definitions import changes
from celery_driftsafe.exceptions import TaskRefused
from celery_driftsafe.models import BeatNode, PeriodicTask, Run, RunKind, RunStatus
from celery_driftsafe.publish import run_now
from celery_driftsafe.testing import FakeClock
from tests import settings as test_settings
from tests.skip_guard import configuration
from tests.support import T0, drain
from tests.support.admin_forms import ADD, RUNS, TASKS, form_data, form_errors
from tests.support.factories import crontab_task, interval_task

NODES = reverse("admin:celery_driftsafe_beatnode_changelist")
S = timedelta(seconds=1)
#: An app to load by dotted path (not made the current app).
DOTTED_APP = Celery("admin-tests-dotted", set_as_current=False)
#: The broker queue of the run-now tests: their own, so other runs on the same Redis do not
#: mix their messages in.
QUEUE = f"driftsafe-admin-tests-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def wakeups(redis_client: Any) -> Iterator[Any]:
    """Counts schedule-change notifications published while the test runs, on a channel of
    its own (a key prefix unique to the test: other runs on the same Redis publish too)."""
    prefix = f"{test_settings.RUN_PREFIX}-{uuid.uuid4().hex[:12]}"
    with override_settings(DRIFTSAFE={**settings.DRIFTSAFE, "KEY_PREFIX": prefix}):
        pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(f"{prefix}:changes")
        pubsub.get_message(timeout=1.0)  # the subscription's confirmation
        yield lambda: _count(pubsub)
        pubsub.close()


def _count(pubsub: Any) -> int:
    seen = 0
    while pubsub.get_message(timeout=0.3) is not None:
        seen += 1
    return seen


def action(client: Any, name: str, tasks: list[PeriodicTask]) -> Any:
    return client.post(
        TASKS, {"action": name, "_selected_action": [t.pk for t in tasks]}, follow=True
    )


def page_messages(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]]


# -- the form --------------------------------------------------------------------------------


@pytest.mark.django_db
def test_add_crontab_task_computes_next_slot_from_the_authority(
    admin_client: Any, app: Any, django_capture_on_commit_callbacks: Any, wakeups: Any
) -> None:
    before = changes.authority_now()
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(ADD, form_data())
    after = changes.authority_now()
    assert response.status_code == 302
    task = PeriodicTask.objects.get(name="nightly")
    schedule = Crontab(minute="*/15", timezone="Europe/Berlin")
    assert task.next_slot_at is not None
    assert schedule.next_after(before) <= task.next_slot_at <= schedule.next_after(after)
    assert (task.args, task.kwargs, task.enabled) == ([1, 2], {}, True)
    assert wakeups() == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("fields", "field", "said"),
    [
        ({"args": "[1, 2, 3]"}, "args", "takes 2 positional arguments but 3 were given"),
        ({"args": "[1]", "kwargs": '{"z": 1}'}, "kwargs", "unexpected keyword argument 'z'"),
        ({"args": "[]"}, "args", "missing 2 required positional arguments: 'x' and 'y'"),
    ],
    ids=["too many", "unknown keyword", "too few"],
)
def test_arguments_the_task_cannot_take_are_a_form_error_naming_the_signature(
    admin_client: Any, app: Any, fields: dict[str, str], field: str, said: str
) -> None:
    """Celery checks a message's arguments against the task's signature when it publishes: a
    save that passed would have every slot fail from then on. The form refuses it, naming the
    argument and the signature, and saves nothing."""
    response = admin_client.post(ADD, form_data(**fields))
    errors = form_errors(response)
    assert list(errors) == [field], errors
    [message] = errors[field]
    assert message.startswith("tests.add(x, y) cannot be called with these arguments")
    assert said in message, message
    assert not PeriodicTask.objects.exists()


@pytest.mark.django_db
def test_a_task_taking_any_keyword_or_a_name_the_app_does_not_know_is_saved_as_typed(
    admin_client: Any, app: Any
) -> None:
    """``**kwargs`` takes any keyword; a task another process registers cannot be checked here,
    so its arguments are saved as typed (as before)."""

    @app.task(name="tests.anything", shared=False)
    def anything(a: int, **rest: Any) -> int:
        return a

    response = admin_client.post(
        ADD, form_data(task="tests.anything", args="[1]", kwargs='{"z": 1, "w": 2}')
    )
    assert response.status_code == 302, form_errors(response)
    assert PeriodicTask.objects.get(name="nightly").kwargs == {"z": 1, "w": 2}
    assert app.tasks.get("tests.elsewhere") is None
    assert celery_app.argument_problem(app, "tests.elsewhere", [1, 2, 3], {"z": 1}) is None


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", ["action", "button"])
def test_run_now_refuses_arguments_the_task_cannot_take_and_writes_nothing(
    admin_client: Any, app: Any, how: str
) -> None:
    """A row changed behind the form (args the task cannot take): run now refuses it with
    the signature and writes no run, as for any row the claim would refuse."""
    task = interval_task("stored", 60, anchor=T0, task="tests.add", queue=QUEUE)
    PeriodicTask.objects.filter(pk=task.pk).update(args=[1, 2, 3])
    stored = PeriodicTask.objects.get(pk=task.pk)
    if how == "action":
        response = action(admin_client, "run_now", [stored])
    else:
        response = run_now_button(admin_client, stored)
    [text] = page_messages(response)
    assert text.startswith("Not run, stored cannot be published: args: tests.add(x, y) cannot be")
    assert "takes 2 positional arguments but 3 were given" in text, text
    assert Run.objects.count() == 0 and drain(QUEUE) == []
    with pytest.raises(TaskRefused, match="takes 2 positional arguments"):
        run_now.run_now(stored, actor="test")
    assert Run.objects.count() == 0 and drain(QUEUE) == []


@pytest.mark.django_db
def test_a_time_authority_out_of_reach_is_a_form_error_and_nothing_is_lost(
    admin_client: Any, app: Any
) -> None:
    """``TIME_AUTHORITY = "redis"`` with Redis down: saving needs the authority's now for the
    next slot. The form says so and keeps what was typed (it was a server error)."""
    away = {**settings.DRIFTSAFE, "TIME_AUTHORITY": "redis", "REDIS_URL": "redis://127.0.0.1:9/0"}
    with override_settings(DRIFTSAFE=away):
        response = admin_client.post(ADD, form_data())
    assert response.status_code == 200
    form = response.context["adminform"].form
    assert form.non_field_errors() == [
        "The time authority cannot be read, so the task's next slot cannot be computed; "
        "nothing was saved. Try again once it is back (redis clock unreachable: Error 111 "
        "connecting to 127.0.0.1:9. Connection refused.)."
    ]
    assert form.data["name"] == "nightly" and not PeriodicTask.objects.exists()
    assert admin_client.post(ADD, form_data()).status_code == 302  # the authority is back
    assert PeriodicTask.objects.get(name="nightly").next_slot_at is not None


@pytest.mark.django_db
def test_unknown_task_name_is_refused_on_the_task_field(admin_client: Any, app: Any) -> None:
    errors = form_errors(admin_client.post(ADD, form_data(task="tests.nope")))
    assert list(errors) == ["task"]
    assert "'tests.nope' is not a task registered" in errors["task"][0]
    assert not PeriodicTask.objects.exists()


@pytest.mark.django_db
def test_importing_the_task_modules_keeps_the_request_s_url_prefix(
    admin_client: Any, app: Any
) -> None:
    """Celery's Django fix-up sets Django up again when the task modules are imported, which
    resets the thread's URL prefix: the admin's redirects under a prefix must keep it."""
    from django.urls import set_script_prefix

    set_script_prefix("/sub/")  # what a WSGI server under /sub does for each request
    try:
        response = admin_client.post(ADD, form_data())
    finally:
        set_script_prefix("/")
    assert response.status_code == 302
    assert response["Location"].startswith("/sub/admin/"), response["Location"]


@pytest.mark.django_db
def test_a_new_task_starts_in_the_celery_app_s_time_zone(admin_client: Any, app: Any) -> None:
    """As Celery's own beat evaluates a crontab in the app's zone (``CELERY_TIMEZONE``, else
    Django's ``TIME_ZONE``), the add form starts there; a zone in the URL, or a task's own on
    its change page, is kept."""

    def shown(url: str) -> str:
        return str(admin_client.get(url).context["adminform"].form["timezone"].value())

    assert shown(ADD) == "UTC"  # the app names none
    app.conf.timezone = "Asia/Tokyo"
    assert shown(ADD) == "Asia/Tokyo"
    assert shown(ADD + "?timezone=Europe/Berlin") == "Europe/Berlin"
    task = crontab_task("berlin", "0 3 * * *", timezone="Europe/Berlin")
    change = reverse("admin:celery_driftsafe_periodictask_change", args=[task.pk])
    assert shown(change) == "Europe/Berlin"
    response = admin_client.post(ADD, form_data(timezone="Asia/Tokyo"))
    assert response.status_code == 302
    assert PeriodicTask.objects.get(name="nightly").timezone == "Asia/Tokyo"


@pytest.mark.django_db
def test_a_name_already_taken_is_refused_on_the_name_field(admin_client: Any, app: Any) -> None:
    """The name is unique through a constraint (no LIKE twin index): the form still says so on
    the field, and the first task is left as it was."""
    assert admin_client.post(ADD, form_data()).status_code == 302
    errors = form_errors(admin_client.post(ADD, form_data(crontab_minute="5")))
    assert errors == {"name": ["Periodic task with this Name already exists."]}
    assert list(PeriodicTask.objects.values_list("crontab_minute", flat=True)) == ["*/15"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("crontab_minute", "61", "61 is out of range 0-59"),
        ("crontab_hour", "24", "24 is out of range 0-23"),
        ("crontab_day_of_month", "0", "0 is out of range 1-31"),
        ("crontab_month_of_year", "13", "13 is out of range 1-12"),
        ("crontab_day_of_week", "funday", "'funday' is not a number or a name"),
        ("crontab_minute", "*/0", "step 0 is not allowed"),
        ("crontab_hour", "", "is empty"),
        ("crontab_second", "60", "60 is out of range 0-59"),
        ("crontab_second", "*/0", "step 0 is not allowed"),
    ],
)
def test_invalid_crontab_field_is_refused_on_that_field(
    admin_client: Any, app: Any, field: str, value: str, message: str
) -> None:
    errors = form_errors(admin_client.post(ADD, form_data(**{field: value})))
    assert list(errors) == [field]
    assert message in errors[field][0]
    assert not PeriodicTask.objects.exists()


@pytest.mark.django_db
def test_every_bad_crontab_field_gets_its_own_error(admin_client: Any, app: Any) -> None:
    errors = form_errors(
        admin_client.post(
            ADD,
            form_data(
                crontab_minute="60",
                crontab_hour="x",
                crontab_day_of_week="8",
                timezone="Nowhere/City",
            ),
        )
    )
    assert sorted(errors) == sorted(
        ["crontab_minute", "crontab_hour", "crontab_day_of_week", "timezone"]
    )


@pytest.mark.django_db
def test_crontab_that_never_fires_is_refused_on_day_of_month(admin_client: Any, app: Any) -> None:
    errors = form_errors(
        admin_client.post(
            ADD,
            form_data(
                crontab_minute="0",
                crontab_hour="0",
                crontab_day_of_month="31",
                crontab_month_of_year="2",
            ),
        )
    )
    assert list(errors) == ["crontab_day_of_month"]
    assert "never fire" in errors["crontab_day_of_month"][0]


@pytest.mark.django_db
@pytest.mark.parametrize("kind", ["crontab", "interval"])
def test_invalid_time_zone_is_refused_on_the_timezone_field(
    admin_client: Any, app: Any, kind: str
) -> None:
    errors = form_errors(
        admin_client.post(
            ADD,
            form_data(
                schedule_kind=kind,
                interval_every="30",
                timezone="Mars/Olympus_Mons",
            ),
        )
    )
    assert list(errors) == ["timezone"]
    assert "unknown time zone 'Mars/Olympus_Mons'" in errors["timezone"][0]


@pytest.mark.django_db
@pytest.mark.parametrize("every", ["0", "-5", ""])
def test_non_positive_interval_is_refused_on_interval_every(
    admin_client: Any, app: Any, every: str
) -> None:
    errors = form_errors(
        admin_client.post(
            ADD,
            form_data(
                schedule_kind="interval",
                interval_every=every,
            ),
        )
    )
    assert errors == {"interval_every": ["An interval must be a positive whole number, e.g. 30."]}


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("args", '{"x": 1}', "Arguments must be a JSON list"),
        ("args", '"one"', "Arguments must be a JSON list"),
        ("args", "[1, 2", "Enter a valid JSON"),
        ("kwargs", "[1, 2]", "Keyword arguments must be a JSON object"),
        ("kwargs", "3", "Keyword arguments must be a JSON object"),
        ("kwargs", "{x: 1}", "Enter a valid JSON"),
        ("headers", "[]", "Headers must be a JSON object"),
    ],
)
def test_args_and_kwargs_must_be_a_json_list_and_object(
    admin_client: Any, app: Any, field: str, value: str, message: str
) -> None:
    errors = form_errors(admin_client.post(ADD, form_data(**{field: value})))
    assert list(errors) == [field]
    assert message in errors[field][0]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("args", "[1, NaN]", "holds NaN, which is not a finite number"),
        ("kwargs", '{"a": Infinity}', "holds Infinity, which is not a finite number"),
        ("headers", '{"x-limit": -Infinity}', "holds -Infinity"),
        ("args", "[1e999]", "holds inf, which is not a finite number (JSON has no NaN"),
        # Python's JSON parser runs out of stack near 1,000 levels inside a request
        ("args", "[" * 1000 + "]" * 1000, "nests 1000 levels deep, more than 64"),
        ("kwargs", '{"a": ' + "[" * 70 + "1" + "]" * 70 + "}", "nests 71 levels deep"),
        # Python refuses to read a whole number of more than 4,300 digits
        ("kwargs", '{"n": ' + "9" * 5000 + "}", "whole number of more than 4,300 digits"),
        ("args", '["a\\u0000b"]', "NUL character"),
    ],
)
def test_json_a_task_cannot_send_is_refused_on_its_field(
    admin_client: Any, app: Any, field: str, value: str, message: str
) -> None:
    """NaN, Infinity, nesting past 64 levels and numbers past Python's digit limit were a
    server error (the database refused NaN, Python's parser raised); now each is an error on
    the field it was typed in, the text shown again as typed, nothing saved."""
    response = admin_client.post(ADD, form_data(**{field: value}))
    errors = form_errors(response)
    assert list(errors) == [field]
    assert "cannot be sent with a task" in errors[field][0] and message in errors[field][0]
    assert value[:30].replace('"', "&quot;") in response.content.decode()
    assert not PeriodicTask.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        # the slot plus up to a day of jitter would be past 9999-12-31: a server error before
        (
            {
                "schedule_kind": "one_off",
                "one_off_at_0": "9999-12-31",
                "one_off_at_1": "23:00:00",
                "jitter_seconds": "86400",
            },
            "one_off_at",
        ),
        (
            {"valid_from_0": "9999-12-31", "valid_from_1": "00:00:00", "jitter_seconds": "3600"},
            "valid_from",
        ),
        (
            {"schedule_kind": "one_off", "one_off_at_0": "0001-01-01", "one_off_at_1": "00:00:00"},
            "one_off_at",
        ),
    ],
)
def test_instants_at_the_ends_of_the_calendar_are_refused_on_their_field(
    admin_client: Any, app: Any, overrides: dict[str, str], field: str
) -> None:
    errors = form_errors(admin_client.post(ADD, form_data(**overrides)))
    assert list(errors) == [field]
    assert "must be from 0001-01-03 to 9899-12-28 (UTC)" in errors[field][0]
    assert "must stay in the calendar" in errors[field][0]
    assert not PeriodicTask.objects.exists()


@pytest.mark.django_db
def test_an_error_on_a_field_the_form_does_not_show_goes_above_the_fields(
    admin_client: Any, app: Any
) -> None:
    """An interval anchor written behind save()'s back past the calendar's margin: the form
    has no anchor field, and Django's form refused an error on it (a server error)."""
    task = interval_task("far", 10, anchor=T0)
    PeriodicTask.objects.filter(pk=task.pk).update(interval_anchor=datetime(9950, 1, 1, tzinfo=UTC))
    change = reverse("admin:celery_driftsafe_periodictask_change", args=[task.pk])
    errors = form_errors(
        admin_client.post(
            change, form_data(name="far", schedule_kind="interval", interval_every="10")
        )
    )
    assert list(errors) == ["__all__"]
    assert errors["__all__"][0].startswith("interval_anchor: must be from 0001-01-03")


@pytest.mark.django_db
def test_one_off_needs_its_instant(admin_client: Any, app: Any) -> None:
    errors = form_errors(admin_client.post(ADD, form_data(schedule_kind="one_off")))
    assert list(errors) == ["one_off_at"]


@pytest.mark.django_db
def test_interval_and_one_off_tasks_can_be_added(admin_client: Any, app: Any) -> None:
    assert (
        admin_client.post(
            ADD,
            form_data(
                name="every-30",
                schedule_kind="interval",
                interval_every="30",
                interval_unit="minutes",
            ),
        ).status_code
        == 302
    )
    assert (
        admin_client.post(
            ADD,
            form_data(
                name="once",
                schedule_kind="one_off",
                one_off_at_0="2030-01-02",
                one_off_at_1="03:04:05",
            ),
        ).status_code
        == 302
    )
    every = PeriodicTask.objects.get(name="every-30")
    assert every.interval_anchor is not None
    assert every.next_slot_at == every.interval_anchor + timedelta(minutes=30)
    once = PeriodicTask.objects.get(name="once")
    assert once.next_slot_at == once.one_off_at == datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)


@pytest.mark.django_db
def test_solar_task_can_be_added_and_shows_its_schedule(admin_client: Any, app: Any) -> None:
    before = changes.authority_now()
    assert (
        admin_client.post(
            ADD,
            form_data(
                name="dusk",
                schedule_kind="solar",
                solar_event="sunset",
                solar_latitude="52.52",
                solar_longitude="13.405",
            ),
        ).status_code
        == 302
    )
    task = PeriodicTask.objects.get(name="dusk")
    assert (task.solar_event, task.solar_latitude, task.solar_longitude) == (
        "sunset",
        52.52,
        13.405,
    )
    assert task.next_slot_at == Solar("sunset", 52.52, 13.405).next_after(before)
    listing = admin_client.get(TASKS).content.decode()
    assert "at sunset at 52.52°N 13.405°E" in listing
    page = admin_client.get(
        reverse("admin:celery_driftsafe_periodictask_change", args=[task.pk])
    ).content.decode()
    assert 'name="solar_latitude"' in page and '<option value="sunset" selected>' in page


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("overrides", "errors_expected"),
    [
        (
            {},
            {
                "solar_event": "needs the event",
                "solar_latitude": "needs a latitude",
                "solar_longitude": "needs a longitude",
            },
        ),
        (
            {"solar_event": "noon", "solar_latitude": "95", "solar_longitude": "-181"},
            {
                "solar_event": "Select a valid choice",
                "solar_latitude": "between -90 and 90",
                "solar_longitude": "between -180 and 180",
            },
        ),
        (
            {"solar_event": "sunrise", "solar_latitude": "north", "solar_longitude": "inf"},
            {"solar_latitude": "Enter a number", "solar_longitude": "Enter a number"},
        ),
        (
            {"solar_event": "sunrise", "solar_latitude": "-90.5", "solar_longitude": "0"},
            {"solar_latitude": "between -90 and 90"},
        ),
    ],
)
def test_solar_fields_are_checked_each_on_its_own(
    admin_client: Any, app: Any, overrides: dict[str, str], errors_expected: dict[str, str]
) -> None:
    errors = form_errors(admin_client.post(ADD, form_data(schedule_kind="solar", **overrides)))
    assert sorted(errors) == sorted(errors_expected)
    for field, message in errors_expected.items():
        assert message in errors[field][0], errors[field]
    assert not PeriodicTask.objects.exists()


@pytest.mark.django_db
def test_crontab_with_seconds_can_be_added_and_empty_seconds_mean_zero(
    admin_client: Any, app: Any
) -> None:
    before = changes.authority_now()
    assert (
        admin_client.post(
            ADD, form_data(name="fast", crontab_second="*/10", crontab_minute="*")
        ).status_code
        == 302
    )
    assert admin_client.post(ADD, form_data(name="plain", crontab_second="")).status_code == 302
    fast = PeriodicTask.objects.get(name="fast")
    assert fast.crontab_second == "*/10"
    expected = Crontab.from_expression("*/10 * * * * *", "Europe/Berlin").next_after(before)
    assert fast.next_slot_at is not None and expected is not None
    assert expected <= fast.next_slot_at <= expected + timedelta(seconds=10)
    assert PeriodicTask.objects.get(name="plain").crontab_second == "0"
    listing = admin_client.get(TASKS).content.decode()
    assert "Every 10 seconds" in listing or "every 10 seconds" in listing


@pytest.mark.django_db
def test_add_page_suggests_registered_tasks_and_zones(admin_client: Any, app: Any) -> None:
    page = admin_client.get(ADD).content.decode()
    assert '<option value="tests.add">' in page
    assert '<option value="Europe/Berlin">' in page


@pytest.mark.django_db
def test_the_form_offers_overlap_policy_buffer_one_and_explains_it(
    admin_client: Any, app: Any
) -> None:
    page = admin_client.get(ADD).content.decode()
    assert '<option value="buffer_one">Keep one slot waiting while the previous run is running' in (
        page
    )
    assert "buffer_one: wait (one slot at most, further ones are skipped)" in page
    errors = form_errors(admin_client.post(ADD, form_data(overlap_policy="buffer_two")))
    assert list(errors) == ["overlap_policy"]
    assert admin_client.post(ADD, form_data(overlap_policy="buffer_one")).status_code == 302
    assert PeriodicTask.objects.get(name="nightly").overlap_policy == "buffer_one"


@pytest.mark.django_db
def test_the_form_offers_buffer_all_stating_its_bound_and_the_task_page_counts_waiting_runs(
    admin_client: Any, app: Any
) -> None:
    """Overlap policy ``buffer_all``: offered by the form, whose help text states how many
    runs may wait; the task's page says how many of its runs wait, of at most how many,
    linked to them in the run list."""
    page = admin_client.get(ADD).content.decode()
    assert '<option value="buffer_all">Keep every slot waiting' in page
    assert "buffer_all: wait, every slot (up to 10 at once, further ones are skipped)" in page
    assert admin_client.post(ADD, form_data(overlap_policy="buffer_all")).status_code == 302
    task = PeriodicTask.objects.get(name="nightly")
    assert task.overlap_policy == "buffer_all"
    change = reverse("admin:celery_driftsafe_periodictask_change", args=[task.pk])
    assert "none" in _readonly(admin_client.get(change).content.decode(), "waiting")
    for second in (1, 2, 3):
        Run.objects.create(
            periodic_task=task,
            task_name=task.task,
            slot=datetime(2026, 3, 1, 0, 0, second, tzinfo=UTC),
            status=RunStatus.WAITING if second > 1 else RunStatus.STARTED,
        )
    shown = _readonly(admin_client.get(change).content.decode(), "waiting")
    assert "2 waiting</a> of at most 10 (overlap policy buffer_all)" in shown
    assert f"periodic_task={task.pk}&amp;status__exact=waiting" in shown
    assert (
        admin_client.get(f"{RUNS}?periodic_task={task.pk}&status__exact=waiting").status_code == 200
    )


def _readonly(page: str, field: str) -> str:
    """The text of the read-only field ``field`` on an admin change page."""
    start = page.index(f"field-{field}")
    return page[start : page.index("</div>", page.index("readonly", start))]


@pytest.mark.django_db
def test_the_form_offers_overlap_policy_replace_and_says_what_a_threads_pool_does(
    admin_client: Any, app: Any
) -> None:
    """Overlap policy ``replace``: offered by the form, whose help text says what a pool that
    cannot terminate a body does."""
    page = admin_client.get(ADD).content.decode()
    assert '<option value="replace">Replace the running run: revoke it' in page
    assert "replace on a threads pool (or solo) waits for the running body to end" in page
    assert admin_client.post(ADD, form_data(overlap_policy="replace")).status_code == 302
    assert PeriodicTask.objects.get(name="nightly").overlap_policy == "replace"


@pytest.mark.django_db
def test_a_form_opened_before_the_task_finished_does_not_switch_it_back_on(
    admin_client: Any, app: Any
) -> None:
    """The change form carries the switch as it showed it (``initial-enabled``). Opened while
    the task was enabled and saved after the scheduler disabled it (it finished), with the box
    left as shown, the save keeps the task disabled; ticking the box of a form that showed
    the task disabled switches it on."""
    task = crontab_task("nightly", "*/15 * * * *", timezone="Europe/Berlin", run_once=True)
    change = reverse("admin:celery_driftsafe_periodictask_change", args=[task.pk])
    page = admin_client.get(change).content.decode()
    assert 'name="initial-enabled"' in page and 'name="initial-disabled_reason"' in page
    finished = {"enabled": False, "disabled_reason": "finished: run once"}
    PeriodicTask.objects.filter(pk=task.pk).update(**finished, next_slot_at=None, due_at=None)
    shown = {"initial-enabled": "True", "initial-disabled_reason": "", "run_once": "on"}
    response = admin_client.post(change, form_data(**shown, description="edited"))
    assert response.status_code == 302, form_errors(response)
    task.refresh_from_db()
    assert (task.enabled, task.disabled_reason, task.description) == (
        False,
        "finished: run once",
        "edited",
    )
    assert task.next_slot_at is None
    shown = {"initial-enabled": "False", "initial-disabled_reason": "finished: run once"}
    response = admin_client.post(
        change, form_data(**shown, run_once="on", disabled_reason="finished: run once")
    )
    assert response.status_code == 302, form_errors(response)
    task.refresh_from_db()
    assert task.enabled and task.disabled_reason == "" and task.next_slot_at is not None


@pytest.mark.django_db
def test_editing_the_schedule_recomputes_next_slot_once_and_wakes_beats(
    admin_client: Any, app: Any, django_capture_on_commit_callbacks: Any, wakeups: Any
) -> None:
    task = interval_task("tick", 10, anchor=T0)
    change = reverse("admin:celery_driftsafe_periodictask_change", args=[task.pk])
    wakeups()
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(
            change,
            form_data(
                name="tick",
                schedule_kind="interval",
                interval_every="7",
                timezone="UTC",
            ),
        )
    assert response.status_code == 302
    task.refresh_from_db()
    now = changes.authority_now()
    assert task.interval_anchor == T0  # kept: slots stay anchor + k * every
    assert task.next_slot_at is not None
    assert (task.next_slot_at - T0) % timedelta(seconds=7) == timedelta(0)
    assert now - 7 * S < task.next_slot_at <= now + 7 * S
    assert wakeups() == 1
    # an edit that leaves the schedule alone leaves the next slot alone
    before = task.next_slot_at
    admin_client.post(
        change,
        form_data(
            name="tick",
            schedule_kind="interval",
            interval_every="7",
            timezone="UTC",
            args="[9, 10]",
        ),
    )
    task.refresh_from_db()
    assert task.args == [9, 10] and task.next_slot_at == before


# -- actions ---------------------------------------------------------------------------------


@pytest.mark.django_db
def test_enable_action_starts_after_now_without_catch_up(
    admin_client: Any, app: Any, django_capture_on_commit_callbacks: Any, wakeups: Any
) -> None:
    old = T0 - timedelta(days=30)
    task = interval_task("paused", 60, anchor=old, next_slot_at=old)
    PeriodicTask.objects.filter(pk=task.pk).update(enabled=False, disabled_reason="ops")
    broken = interval_task("broken", 60, anchor=old)
    PeriodicTask.objects.filter(pk=broken.pk).update(
        enabled=False, schedule_kind="crontab", crontab_minute="99"
    )
    with django_capture_on_commit_callbacks(execute=True):
        response = action(admin_client, "enable_tasks", [task, broken])
    now = changes.authority_now()
    task.refresh_from_db()
    assert task.enabled and task.disabled_reason == ""
    assert task.next_slot_at is not None and now - 60 * S < task.next_slot_at <= now + 60 * S
    assert (task.next_slot_at - old) % timedelta(seconds=60) == timedelta(0)
    assert not PeriodicTask.objects.get(pk=broken.pk).enabled
    texts = page_messages(response)
    assert any("Not enabled, it cannot fire: broken" in t for t in texts)
    assert "Enabled 1 task(s): paused" in texts
    assert wakeups() == 1


@pytest.mark.django_db
def test_disable_action_records_who_and_wakes_beats(
    admin_client: Any, app: Any, django_capture_on_commit_callbacks: Any, wakeups: Any
) -> None:
    tasks = [interval_task(f"t{i}", 10, anchor=T0) for i in range(3)]
    wakeups()
    with django_capture_on_commit_callbacks(execute=True):
        response = action(admin_client, "disable_tasks", tasks[:2])
    assert "Disabled 2 task(s)." in page_messages(response)
    states = dict(PeriodicTask.objects.values_list("name", "enabled"))
    assert states == {"t0": False, "t1": False, "t2": True}
    assert PeriodicTask.objects.get(name="t0").disabled_reason == "disabled in the admin by admin"
    assert wakeups() == 1


@pytest.mark.django_db
def test_reset_schedule_action_drops_the_backlog(
    admin_client: Any, app: Any, django_capture_on_commit_callbacks: Any, wakeups: Any
) -> None:
    task = crontab_task("late", "*/5 * * * *", next_slot_at=T0 - timedelta(days=2))
    before = changes.authority_now()
    with django_capture_on_commit_callbacks(execute=True):
        response = action(admin_client, "reset_schedule", [task])
    task.refresh_from_db()
    schedule = Crontab(minute="*/5")
    assert task.next_slot_at is not None
    assert schedule.next_after(before) <= task.next_slot_at
    assert task.next_slot_at <= schedule.next_after(changes.authority_now())
    assert "Reset the schedule of 1 task(s)." in page_messages(response)
    assert wakeups() == 1


@pytest.mark.django_db(transaction=True)
def test_run_now_action_goes_through_the_ledger_and_the_broker(admin_client: Any, app: Any) -> None:
    task = crontab_task("report", "0 3 * * *", args=[4, 5], queue=QUEUE)
    next_slot = PeriodicTask.objects.get(pk=task.pk).next_slot_at
    before = changes.authority_now()
    response = action(admin_client, "run_now", [task])
    after = changes.authority_now()
    run = Run.objects.get()
    assert run.kind == RunKind.MANUAL and run.status == RunStatus.DISPATCHED
    assert run.slot is not None and before <= run.slot <= after
    assert run.claimed_at == run.slot and run.dispatched_at is not None
    assert run.claimed_by == "admin:admin"
    assert run.celery_task_id == celery_task_id(task.pk, run.slot)
    [message] = drain(QUEUE)
    assert message["id"] == run.celery_task_id and message["args"] == [4, 5]
    assert message[HEADER_RUN_ID] == run.pk and message[HEADER_SLOT] == run.slot.isoformat()
    assert any("dispatched" in t for t in page_messages(response))
    # the schedule is untouched, and the run is visible in the ledger
    assert PeriodicTask.objects.get(pk=task.pk).next_slot_at == next_slot
    assert f"#{run.pk}" in admin_client.get(RUNS).content.decode()
    # running again is a new run at a new instant, with its own task id
    action(admin_client, "run_now", [task])
    assert Run.objects.count() == 2 and len(drain(QUEUE)) == 1


@pytest.mark.django_db(transaction=True)
def test_run_now_of_a_task_this_process_has_not_imported_is_published_by_name(
    admin_client: Any, app: Any
) -> None:
    # The web process need not import every task module: the worker that has it runs it.
    task = interval_task("ghost", 60, anchor=T0, queue=QUEUE)
    PeriodicTask.objects.filter(pk=task.pk).update(task="tests.gone")
    action(admin_client, "run_now", [task])
    run = Run.objects.get()
    assert run.status == RunStatus.DISPATCHED and run.error == ""
    assert [m["task"] for m in drain(QUEUE)] == ["tests.gone"]


@pytest.mark.django_db(transaction=True)
def test_run_now_is_deduplicated_by_task_and_instant(app: Any) -> None:
    task = interval_task("dup", 60, anchor=T0, queue=QUEUE)
    clock = FakeClock(T0 + 5 * S)
    first = run_now.run_now(task, clock=clock, actor="test")
    second = run_now.run_now(task, clock=clock, actor="test")
    assert first.created and first.status == RunStatus.DISPATCHED
    assert not second.created and second.run_id == first.run_id
    assert second.celery_task_id == first.celery_task_id
    assert Run.objects.count() == 1 and len(drain(QUEUE)) == 1


@pytest.mark.django_db(transaction=True)
def test_run_now_inside_a_transaction_publishes_after_commit(app: Any) -> None:
    from django.db import transaction

    task = interval_task("atomic", 60, anchor=T0, queue=QUEUE)
    with transaction.atomic():
        result = run_now.run_now(task, clock=FakeClock(T0), actor="test")
        assert result.deferred and drain(QUEUE) == []
    assert [m["id"] for m in drain(QUEUE)] == [result.celery_task_id]
    assert Run.objects.get().status == RunStatus.DISPATCHED


def run_now_button(client: Any, task: PeriodicTask) -> Any:
    url = reverse("admin:celery_driftsafe_periodictask_run_now", args=[task.pk])
    return client.post(url, follow=True)


#: Rows written behind ``save()`` (``QuerySet.update``, raw SQL, a fixture) that the claim
#: refuses: run now refuses them too, with the field at fault on the page.
_UNPUBLISHABLE: list[tuple[str, dict[str, Any], str]] = [
    ("forged", {"headers": {"task": "exp.danger", "id": "forged-id"}}, "must not set id, task"),
    ("compression", {"headers": {"compression": "zlib"}}, "must not set compression"),
    ("own-header", {"headers": {"driftsafe_run_id": 1}}, "must not set driftsafe_run_id"),
    ("args-text", {"args": "1, 2"}, "args: must be a JSON list"),
    ("args-number", {"args": 5}, "args: must be a JSON list"),
    ("kwargs-list", {"kwargs": [1, 2]}, "kwargs: must be a JSON object"),
    ("kwargs-text", {"kwargs": "[1]"}, "kwargs: must be a JSON object"),
    ("priority", {"priority": 999}, "priority: must be a whole number"),
    ("expiry-overflow", {"expires_seconds": 1e12}, "expires_seconds:"),
]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", ["action", "button"])
@pytest.mark.parametrize(
    ("values", "reason"), [v[1:] for v in _UNPUBLISHABLE], ids=[v[0] for v in _UNPUBLISHABLE]
)
def test_run_now_refuses_what_the_claim_refuses_and_writes_and_sends_nothing(
    admin_client: Any, app: Any, how: str, values: dict[str, Any], reason: str
) -> None:
    task = interval_task("stored", 60, anchor=T0, task="exp.safe", queue=QUEUE)
    PeriodicTask.objects.filter(pk=task.pk).update(**values)
    stored = PeriodicTask.objects.get(pk=task.pk)
    if how == "action":
        response = action(admin_client, "run_now", [stored])
    else:
        response = run_now_button(admin_client, stored)
    assert response.status_code == 200
    [text] = page_messages(response)
    assert text.startswith("Not run, stored cannot be published: "), text
    assert reason in text, text
    assert Run.objects.count() == 0 and drain(QUEUE) == []
    after = PeriodicTask.objects.get(pk=task.pk)
    assert after.enabled and after.changed_at == stored.changed_at  # nothing written
    with pytest.raises(TaskRefused) as refused:
        run_now.run_now(stored, actor="test")
    assert reason in str(refused.value)
    assert Run.objects.count() == 0 and drain(QUEUE) == []


@pytest.mark.django_db(transaction=True)
def test_run_now_reads_json_strings_as_the_claim_does_and_runs_the_others(
    admin_client: Any, app: Any
) -> None:
    """``args``/``kwargs`` stored as a JSON string of the right shape go out as that value
    (not one argument per character), and one refused row does not stop the others."""
    text = interval_task("text", 60, anchor=T0, queue=QUEUE)
    broken = interval_task("broken", 60, anchor=T0, queue=QUEUE)
    PeriodicTask.objects.filter(pk=text.pk).update(args="[1]", kwargs='{"y": 3}')
    PeriodicTask.objects.filter(pk=broken.pk).update(args=5)
    response = action(admin_client, "run_now", [broken, text])
    texts = page_messages(response)
    assert any(t.startswith("Not run, broken cannot be published: args:") for t in texts), texts
    assert any(t.startswith("Run now text") and "dispatched" in t for t in texts), texts
    [message] = drain(QUEUE)
    assert message["args"] == [1] and message["kwargs"] == {"y": 3}
    assert [r.periodic_task_id for r in Run.objects.all()] == [text.pk]


def test_celery_app_from_a_dotted_path() -> None:
    from celery_driftsafe.exceptions import ConfigurationError

    loaded = celery_app.load_celery_app("tests.admin.test_admin:DOTTED_APP")
    assert loaded is DOTTED_APP is celery_app.load_celery_app("tests.admin.test_admin.DOTTED_APP")
    with pytest.raises(ConfigurationError, match="cannot be imported"):
        celery_app.load_celery_app("tests.nowhere:app")
    with pytest.raises(ConfigurationError, match="is not a Celery app"):
        celery_app.load_celery_app("tests.settings:TIME_ZONE")


# -- list pages ------------------------------------------------------------------------------


def _runs(
    task: PeriodicTask, count: int, *, node: str, start: datetime, status: str = RunStatus.SUCCEEDED
) -> list[Run]:
    return [
        Run(
            periodic_task=task,
            task_name=task.task,
            slot=start + i * 60 * S,
            status=status,
            claimed_by=node,
            claimed_at=start + i * 60 * S + 1500 * timedelta(milliseconds=1),
            dispatched_at=start + i * 60 * S + 2 * S,
            started_at=start + i * 60 * S + 3 * S,
            finished_at=start + i * 60 * S + 5250 * timedelta(milliseconds=1),
            celery_task_id=celery_task_id(task.pk, start + i * 60 * S),
        )
        for i in range(count)
    ]


@pytest.mark.django_db
@override_settings(TIME_ZONE="Asia/Kolkata")
def test_task_list_answers_what_runs_next_and_what_ran(admin_client: Any, app: Any) -> None:
    cron = crontab_task(
        "quarterly",
        "*/15 * * * *",
        timezone="Europe/Berlin",
        next_slot_at=datetime(2030, 1, 1, 6, 30, tzinfo=UTC),
    )
    interval_task("five", 300, anchor=T0)
    Run.objects.bulk_create(_runs(cron, 3, node="beat-a", start=T0, status=RunStatus.FAILED))
    page = admin_client.get(TASKS).content.decode()
    assert "Every 15 minutes (Europe/Berlin)" in page  # cron-descriptor
    assert "every 5 minutes" in page  # the interval's own describe()
    assert ">2030-01-01 12:00:00<" in page  # 06:30 UTC in the admin's zone, said once:
    assert page.count("Asia/Kolkata") == 1 and "Times in Asia/Kolkata" in page
    assert "driftsafe-status-failed" in page and 'title="claimed by beat-a"' in page
    assert "never" in page  # "five" has not run
    # the lateness of the last run, the task's path and zone are on the task's page
    change = admin_client.get(
        reverse("admin:celery_driftsafe_periodictask_change", args=[cron.pk])
    ).content.decode()
    assert "+1.500 s" in change and "by beat-a" in change and "driftsafe-status-failed" in change


@pytest.mark.django_db
def test_schedule_falls_back_to_describe_without_cron_descriptor(
    admin_client: Any, app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    crontab_task("quarterly", "*/15 * * * *", timezone="Europe/Berlin")
    monkeypatch.setitem(sys.modules, "cron_descriptor", None)  # import fails
    page = admin_client.get(TASKS).content.decode()
    assert "every 15 minutes (Europe/Berlin)" in page
    assert "Every 15 minutes" not in page


@pytest.mark.django_db
def test_task_list_search_and_filters(admin_client: Any, app: Any) -> None:
    ran = interval_task("ran-and-failed", 60, anchor=T0)
    interval_task("never-ran", 60, anchor=T0, task="tests.other")
    off = interval_task("switched-off", 60, anchor=T0)
    PeriodicTask.objects.filter(pk=off.pk).update(enabled=False)
    Run.objects.bulk_create(_runs(ran, 2, node="n", start=T0, status=RunStatus.FAILED))

    def names(query: str) -> set[str]:
        response = admin_client.get(TASKS + query)
        return {t.name for t in response.context["cl"].result_list}

    assert names("?q=tests.other") == {"never-ran"}
    assert names("?q=switched") == {"switched-off"}
    assert names("?enabled__exact=0") == {"switched-off"}
    assert names("?last_run=failed") == {"ran-and-failed"}
    assert names("?last_run=never") == {"never-ran", "switched-off"}
    assert names("?schedule_kind__exact=crontab") == set()


@pytest.mark.django_db
def test_task_list_sorts_by_last_run_and_reads_each_page_s_runs_once(
    admin_client: Any, app: Any, django_assert_max_num_queries: Any
) -> None:
    """The "last run" column sorts by the latest run's slot (never-run tasks at one end), and
    its cells come from one query for the page (LastRunChangeList), not per row."""
    early = interval_task("early", 60, anchor=T0)
    late = interval_task("late", 60, anchor=T0)
    interval_task("never", 60, anchor=T0)
    Run.objects.bulk_create(_runs(early, 3, node="n", start=T0))
    Run.objects.bulk_create(_runs(late, 1, node="n", start=T0 + 3600 * S, status="failed"))
    column = admin_client.get(TASKS).context["cl"].list_display.index("last_run")

    def order(query: str) -> list[str]:
        with django_assert_max_num_queries(8):
            response = admin_client.get(TASKS + query)
        return [t.name for t in response.context["cl"].result_list]

    ascending, descending = order(f"?o={column}"), order(f"?o=-{column}")
    assert [n for n in ascending if n != "never"] == ["early", "late"]
    assert [n for n in descending if n != "never"] == ["late", "early"]
    assert "never" in (ascending[0], ascending[-1]) and descending == ascending[::-1]
    page = admin_client.get(TASKS + f"?o={column}").content.decode()
    assert page.count("driftsafe-status-failed") == 1
    assert page.count("driftsafe-status-succeeded") == 1


@pytest.mark.django_db
def test_run_list_shows_the_ledger_read_only(admin_client: Any, app: Any) -> None:
    task = interval_task("tick", 60, anchor=T0)
    other = interval_task("tock", 60, anchor=T0)
    Run.objects.bulk_create(_runs(task, 2, node="host-a:1:aa", start=T0))
    Run.objects.bulk_create(_runs(other, 1, node="host-b:2:bb", start=T0, status="failed"))
    BeatNode.objects.create(
        node_id="host-a:1:aa", hostname="host-a", pid=1, started_at=T0, last_heartbeat_at=T0
    )
    page = admin_client.get(RUNS).content.decode()
    for text in (
        "tick",
        "host-a:1:aa",
        "+1.500 s",
        "2.250 s",
        "2026-03-01 12:00:00.000<",
        "Times in UTC",
        ">12:00:01.500<",
        ">12:00:05.250<",
        "driftsafe-status-succeeded",
    ):
        assert text in page
    run = Run.objects.filter(task_name="tests.add").first()
    assert run is not None
    assert f"/admin/django_celery_results/taskresult/?task_id={run.celery_task_id}" in page

    def count(query: str) -> int:
        return len(admin_client.get(RUNS + query).context["cl"].result_list)

    assert count("?status__exact=failed") == 1
    assert count(f"?periodic_task={task.pk}") == 2
    assert count("?node=host-a:1:aa") == 2
    assert count("?node=admin") == 0
    assert count(f"?q={run.celery_task_id}") == 1
    # read-only: no add, no change, no delete
    assert admin_client.get(reverse("admin:celery_driftsafe_run_add")).status_code == 403
    change = reverse("admin:celery_driftsafe_run_change", args=[run.pk])
    assert admin_client.get(change).status_code == 200  # the view-only page
    admin_client.post(change, {"status": "claimed"})
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert (
        admin_client.post(
            reverse("admin:celery_driftsafe_run_delete", args=[run.pk]), {"post": "yes"}
        ).status_code
        == 403
    )


@pytest.mark.django_db
def test_run_search_finds_each_kind_of_term(admin_client: Any, app: Any) -> None:
    """Every part of the run search (all on indexes, see search_runs): a task's name or Celery
    name in part, a manual or ad hoc run's task name in part, exactly a Celery task id, an
    idempotency key or a node; nothing else."""
    nightly = interval_task("nightly-report", 60, anchor=T0, task="tests.add")
    hourly = interval_task("hourly-sync", 60, anchor=T0, task="tests.other")
    Run.objects.bulk_create(_runs(nightly, 3, node="host-a:1:aa", start=T0))
    Run.objects.bulk_create(_runs(hourly, 2, node="host-b:2:bb", start=T0))
    Run.objects.create(
        task_name="billing.charge",
        kind=RunKind.ADHOC,
        status=RunStatus.SUCCEEDED,
        claimed_by="worker-x",
        claimed_at=T0,
        celery_task_id="c0ffee00-0000-4000-8000-000000000001",
        idempotency_key="invoice-42",
    )
    Run.objects.create(
        periodic_task=hourly,
        task_name="tests.other",
        kind=RunKind.MANUAL,
        status=RunStatus.DISPATCHED,
        claimed_by="admin:alice",
        claimed_at=T0,
        celery_task_id="manual-1",
    )
    one = Run.objects.filter(periodic_task=nightly).order_by("slot").first()
    assert one is not None

    def found(term: str) -> list[str]:
        listed = admin_client.get(RUNS, {"q": term}).context["cl"].result_list
        return sorted(f"{run.task_name}/{run.kind}" for run in listed)

    assert found("nightly") == ["tests.add/scheduled"] * 3
    assert found("  HOURLY-sync ") == ["tests.other/manual"] + ["tests.other/scheduled"] * 2
    assert found("tests.oth") == ["tests.other/manual"] + ["tests.other/scheduled"] * 2
    assert found("billing") == ["billing.charge/adhoc"]
    assert found(one.celery_task_id) == ["tests.add/scheduled"]
    assert found("invoice-42") == ["billing.charge/adhoc"]
    assert found("host-b:2:bb") == ["tests.other/scheduled"] * 2
    assert found("admin:alice") == ["tests.other/manual"]
    # exact fields are not searched in part; nothing is found for a term that matches nothing
    assert found("invoice") == []
    assert found("host-b") == []
    assert found("no-such-run") == []
    assert len(found("")) == 7


@pytest.mark.django_db
def test_node_list_shows_liveness_and_highlights_offsets_beyond_the_bound(
    admin_client: Any, app: Any
) -> None:
    now = changes.authority_now()
    BeatNode.objects.create(
        node_id="good:1:a",
        hostname="good",
        pid=1,
        started_at=now,
        last_heartbeat_at=now,
        clock_offset_seconds=0.004,
        clock_rtt_seconds=0.0008,
        clock_measured_at=now,
        lag_seconds=0.25,
    )
    BeatNode.objects.create(
        node_id="skewed:2:b",
        hostname="skewed",
        pid=2,
        started_at=now,
        last_heartbeat_at=now,
        clock_offset_seconds=-1.3,
        clock_rtt_seconds=0.002,
        clock_measured_at=now,
        lag_seconds=95.0,  # past the misfire grace (60 s): the beats are saturated
    )
    BeatNode.objects.create(
        node_id="gone:3:c",
        hostname="gone",
        pid=3,
        started_at=now - timedelta(hours=1),
        last_heartbeat_at=now - timedelta(minutes=5),
    )
    BeatNode.objects.create(
        node_id="quit:4:d",
        hostname="quit",
        pid=4,
        started_at=now,
        last_heartbeat_at=now,
        stopped_at=now,
    )
    page = admin_client.get(NODES).content.decode()
    assert page.count("driftsafe-node-alive") == 2
    assert page.count("driftsafe-node-dead") == 1 and page.count("driftsafe-node-stopped") == 1
    assert page.count("driftsafe-offset-exceeded") == 1
    assert "⚠ -1.300 s" in page and "+0.004 s" in page and "0.8 ms (±0.4 ms)" in page
    assert page.count("driftsafe-saturated") == 1 and "saturated: 1 min 35 s behind" in page
    assert "0.250 s" in page

    def names(query: str) -> set[str]:
        return {n.hostname for n in admin_client.get(NODES + query).context["cl"].result_list}

    assert names("?state=alive") == {"good", "skewed"}
    assert names("?state=dead") == {"gone"}
    assert names("?state=stopped") == {"quit"}
    assert admin_client.get(reverse("admin:celery_driftsafe_beatnode_add")).status_code == 403


@pytest.mark.django_db
def test_list_pages_stay_paginated_and_bounded_with_thousands_of_runs(
    admin_client: Any, app: Any, django_assert_max_num_queries: Any
) -> None:
    tasks = [interval_task(f"task-{i:03d}", 60, anchor=T0) for i in range(120)]
    for n in range(4):
        BeatNode.objects.create(
            node_id=f"node-{n}", hostname=f"host-{n}", pid=n, started_at=T0, last_heartbeat_at=T0
        )
    runs: list[Run] = []
    for i, task in enumerate(tasks[:30]):
        runs += _runs(task, 100, node=f"node-{i % 4}", start=T0)
    Run.objects.bulk_create(runs, batch_size=500)
    assert Run.objects.count() == 3000
    admin_client.get(TASKS)  # the session and user are loaded once
    for url, rows in (
        (TASKS, 100),
        (TASKS + "?p=2", 20),
        (RUNS, 100),
        (RUNS + "?p=29", 100),
        (RUNS + "?status__exact=succeeded&node=node-1", 100),
        (NODES, 4),
        (TASKS + "?last_run=succeeded", 30),
    ):
        with django_assert_max_num_queries(8):
            response = admin_client.get(url)
        assert response.status_code == 200
        assert len(response.context["cl"].result_list) == rows, url
    assert 'class="paginator"' in admin_client.get(RUNS).content.decode()


# -- bounds, limits and jitter -----------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("overrides", "errors_expected"),
    [
        (
            {
                "valid_from_0": "2030-05-01",
                "valid_from_1": "12:00:00",
                "valid_until_0": "2030-04-01",
                "valid_until_1": "12:00:00",
            },
            {"valid_until": "must be after valid from"},
        ),
        (
            {
                "valid_from_0": "2030-05-01",
                "valid_from_1": "12:00:00",
                "valid_until_0": "2030-05-01",
                "valid_until_1": "12:00:00",
            },
            {"valid_until": "must be after valid from"},
        ),
        ({"max_runs": "0"}, {"max_runs": "1 or more"}),
        ({"max_runs": "-3"}, {"max_runs": "1 or more"}),
        ({"jitter_seconds": "-1"}, {"jitter_seconds": "from 0 to 86400"}),
        ({"jitter_seconds": "100000"}, {"jitter_seconds": "from 0 to 86400"}),
        (
            {
                "max_runs": "0",
                "jitter_seconds": "-1",
                "valid_from_0": "2030-05-01",
                "valid_from_1": "12:00:00",
                "valid_until_0": "2030-04-01",
                "valid_until_1": "12:00:00",
            },
            {"max_runs": "1 or more", "jitter_seconds": "from 0 to", "valid_until": "after"},
        ),
    ],
)
def test_bounds_limits_and_jitter_are_checked_each_on_its_field(
    admin_client: Any, app: Any, overrides: dict[str, str], errors_expected: dict[str, str]
) -> None:
    errors = form_errors(admin_client.post(ADD, form_data(**overrides)))
    assert sorted(errors) == sorted(errors_expected)
    for field, message in errors_expected.items():
        assert len(errors[field]) == 1 and message in errors[field][0].lower(), errors[field]
    assert not PeriodicTask.objects.exists()


@pytest.mark.django_db
def test_bounds_limits_and_jitter_are_saved_and_listed(admin_client: Any, app: Any) -> None:
    page = admin_client.get(ADD).content.decode()
    for name in (
        "valid_from",
        "valid_until",
        "run_once",
        "max_runs",
        "jitter_seconds",
        "description",
    ):
        assert f'name="{name}' in page
    assert "Bounds and limits" in page
    response = admin_client.post(
        ADD,
        form_data(
            name="bounded",
            description="quarterly report",
            valid_from_0="2030-05-01",
            valid_from_1="00:00:00",
            valid_until_0="2030-06-01",
            valid_until_1="00:00:00",
            run_once="on",
            max_runs="5",
            jitter_seconds="30",
            crontab_minute="0",
            crontab_hour="6",
            timezone="UTC",
        ),
    )
    assert response.status_code == 302
    task = PeriodicTask.objects.get(name="bounded")
    assert (task.valid_from, task.valid_until) == (
        datetime(2030, 5, 1, tzinfo=UTC),
        datetime(2030, 6, 1, tzinfo=UTC),
    )
    assert (task.run_once, task.max_runs, task.jitter_seconds, task.description) == (
        True,
        5,
        30.0,
        "quarterly report",
    )
    # the first slot is the first 06:00 at or after valid from; due within its jitter
    assert task.next_slot_at == datetime(2030, 5, 1, 6, tzinfo=UTC)
    assert task.due_at is not None
    assert task.next_slot_at <= task.due_at < task.next_slot_at + timedelta(seconds=30)
    change = admin_client.get(
        reverse("admin:celery_driftsafe_periodictask_change", args=[task.pk])
    ).content.decode()
    assert (
        "from 2030-05-01 00:00:00 · until 2030-06-01 00:00:00 · 0 of 5 runs · once · "
        "jitter 30 s" in change
    )
    assert "Due at" in change or "due at" in change.lower()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("typed", "fields"),
    [
        ("@daily", ("0", "0", "0", "*", "*", "*")),
        ("@hourly", ("0", "0", "*", "*", "*", "*")),
        ("@weekly", ("0", "0", "0", "*", "*", "0")),
        ("30 2 * * mon-fri", ("0", "30", "2", "*", "*", "mon-fri")),
        ("*/15 * * * * *", ("*/15", "*", "*", "*", "*", "*")),
    ],
)
def test_a_whole_expression_or_alias_in_the_minute_field_fills_every_crontab_field(
    admin_client: Any, app: Any, typed: str, fields: tuple[str, ...]
) -> None:
    assert admin_client.post(ADD, form_data(crontab_minute=typed)).status_code == 302
    task = PeriodicTask.objects.get(name="nightly")
    assert (
        task.crontab_second,
        task.crontab_minute,
        task.crontab_hour,
        task.crontab_day_of_month,
        task.crontab_month_of_year,
        task.crontab_day_of_week,
    ) == fields


@pytest.mark.django_db
def test_an_expression_in_the_minute_field_is_refused_on_it_when_unreadable_or_ambiguous(
    admin_client: Any, app: Any
) -> None:
    errors = form_errors(admin_client.post(ADD, form_data(crontab_minute="@fortnightly")))
    assert list(errors) == ["crontab_minute"]
    errors = form_errors(
        admin_client.post(ADD, form_data(crontab_minute="@daily", crontab_hour="5"))
    )
    assert list(errors) == ["crontab_minute"] and "left empty" in errors["crontab_minute"][0]
    assert not PeriodicTask.objects.exists()


#: Rows written behind save() that the admin must still show: (name, SET clause, what the
#: task list or its page shows for it). Each gave a 500 on the list or the change page (or
#: the dashboard).
_BROKEN_ROWS: list[tuple[str, str, str]] = [
    ("past-the-calendar", "interval_every = 2147483647, interval_unit = 'days'", "invalid:"),
    ("no-next-slot", "next_slot_at = NULL", "no-next-slot"),
]
if settings.DATABASES["default"]["ENGINE"].endswith("sqlite3"):  # text in number columns
    _BROKEN_ROWS += [
        ("every-text", "interval_every = 'often'", "invalid:"),
        ("jitter-text", "jitter_seconds = 'some'", "jitter invalid"),
    ]


@pytest.mark.django_db
def test_the_task_list_change_page_and_dashboard_show_rows_written_behind_save(
    admin_client: Any, app: Any
) -> None:
    good = interval_task("good", 10, anchor=T0, next_slot_at=T0)
    broken = {
        name: interval_task(name, 10, anchor=T0, next_slot_at=T0) for name, _, _ in _BROKEN_ROWS
    }
    from django.db import connection

    with connection.cursor() as cursor:
        for name, change, _ in _BROKEN_ROWS:
            cursor.execute(
                f"UPDATE celery_driftsafe_periodictask SET {change} WHERE id = %s",
                [broken[name].pk],
            )
    page = admin_client.get(TASKS)
    assert page.status_code == 200
    rows = {
        row.split("</th>")[0].rsplit(">", 2)[-2].split("<")[0]: row
        for row in page.content.decode().split("<tr")[1:]
        if "</th>" in row
    }
    assert good.name in rows
    for name, _, shown in _BROKEN_ROWS:
        change = admin_client.get(
            reverse("admin:celery_driftsafe_periodictask_change", args=[broken[name].pk])
        )
        assert change.status_code == 200, name
        assert shown in rows[name] + change.content.decode(), (name, rows[name])
    dashboard = admin_client.get(reverse("admin:celery_driftsafe_dashboard"))
    assert dashboard.status_code == 200
    assert "no-next-slot" in dashboard.content.decode()


@pytest.mark.django_db
@pytest.mark.skipif(
    not settings.DATABASES["default"]["ENGINE"].endswith("sqlite3"),
    reason=configuration("only SQLite stores any text in an instant column"),
)
def test_tasks_whose_instants_cannot_be_read_are_named_and_the_pages_render(
    admin_client: Any, app: Any
) -> None:
    """Reading such a row raised out of the whole query: the task list and the dashboard
    answered 500 for one row."""
    good = interval_task("good", 10, anchor=T0, next_slot_at=T0)
    due = interval_task("bad-due", 10, anchor=T0, next_slot_at=T0)
    until = interval_task("bad-until", 10, anchor=T0, next_slot_at=T0)
    from django.db import connection

    with connection.cursor() as cursor:
        for task, change in (
            (due, "due_at = '2026-02-30 10:00:00'"),
            (until, "valid_until = '2026-13-45 10:00:00'"),
        ):
            cursor.execute(
                f"UPDATE celery_driftsafe_periodictask SET {change} WHERE id = %s", [task.pk]
            )
    page = admin_client.get(TASKS)
    assert page.status_code == 200
    html = page.content.decode()
    assert f"Task &#x27;bad-due&#x27; (id {due.pk}) cannot be read" in html
    assert "due_at: &#x27;2026-02-30 10:00:00&#x27; is no instant" in html
    assert f"Task &#x27;bad-until&#x27; (id {until.pk}) cannot be read" in html
    assert f"/{good.pk}/change/" in html  # the others are listed
    dashboard = admin_client.get(reverse("admin:celery_driftsafe_dashboard"))
    assert dashboard.status_code == 200
    assert "cannot be read: due_at:" in dashboard.content.decode()
    change = admin_client.get(
        reverse("admin:celery_driftsafe_periodictask_change", args=[until.pk]), follow=True
    )
    assert change.status_code == 200
    assert f"Task id {until.pk} cannot be read: valid_until:" in change.content.decode()
