"""Which :class:`~celery_driftsafe.models.PeriodicTask` fields hold a schedule: one map, used
by the model (building the schedule, blaming a field), the admin form, the admin's layout and
change detection (:mod:`celery_driftsafe.definitions.changes`). Django-free."""

from __future__ import annotations

#: Model field -> the :class:`~celery_driftsafe.core.crontab.Crontab` argument it holds.
CRONTAB_FIELDS = {
    "crontab_second": "second",
    "crontab_minute": "minute",
    "crontab_hour": "hour",
    "crontab_day_of_month": "day_of_month",
    "crontab_month_of_year": "month_of_year",
    "crontab_day_of_week": "day_of_week",
}
INTERVAL_FIELDS = ("interval_every", "interval_unit", "interval_anchor")
ONE_OFF_FIELDS = ("one_off_at",)
SOLAR_FIELDS = ("solar_event", "solar_latitude", "solar_longitude")

#: The fields a person fills in for each schedule kind (the admin form shows and reads only
#: the chosen kind's; the crontab's time zone is not among them: every kind's slots are
#: previewed in it).
KIND_INPUTS = {
    "interval": ("interval_every", "interval_unit"),
    "crontab": tuple(CRONTAB_FIELDS),
    "one_off": ONE_OFF_FIELDS,
    "solar": SOLAR_FIELDS,
}

#: Every field that defines when a task fires: a change to one of them is a schedule edit.
SCHEDULE_FIELDS = (
    "schedule_kind",
    *INTERVAL_FIELDS,
    *CRONTAB_FIELDS,
    "timezone",
    *ONE_OFF_FIELDS,
    *SOLAR_FIELDS,
)
#: The bounds, the jitter and the excluded dates: no schedule of their own, but a change to one
#: of them moves the next slot or its due instant, as a schedule edit does.
TIMING_FIELDS = ("valid_from", "valid_until", "jitter_seconds", "excluded_dates")
#: Every field whose change recomputes a task's next slot
#: (:mod:`celery_driftsafe.definitions.changes`).
RESCHEDULE_FIELDS = (*SCHEDULE_FIELDS, *TIMING_FIELDS)

#: The schedule fields a person edits (the interval's anchor is set when the task is saved).
EDITABLE_SCHEDULE_FIELDS = tuple(name for name in SCHEDULE_FIELDS if name != "interval_anchor")

#: The field to blame when a schedule of this kind cannot be evaluated as a whole.
KIND_FIELD = {
    "interval": "interval_every",
    "crontab": "timezone",
    "one_off": "one_off_at",
    "solar": "solar_event",
}

#: Which model field holds each schedule field named by
#: :class:`~celery_driftsafe.exceptions.ScheduleError`.
ERROR_FIELDS = {
    "every": "interval_every",
    "anchor": "interval_anchor",
    **{argument: field for field, argument in CRONTAB_FIELDS.items()},
    "timezone": "timezone",
    "expression": "crontab_minute",
    "at": "one_off_at",
    "event": "solar_event",
    "latitude": "solar_latitude",
    "longitude": "solar_longitude",
    "schedule_kind": "schedule_kind",
    "excluded_dates": "excluded_dates",
    "calendars": "calendars",
}
