"""The periodic task form: everything is validated before anything is saved.

Each problem is reported on the field at fault, all at once (not the first one only):

* ``task`` — must be registered with the project's Celery app
  (:func:`celery_driftsafe.celery_app.get_celery_app`), once its task modules are imported as
  a worker imports them (:func:`~celery_driftsafe.celery_app.load_task_modules`: the web
  process has not); a module that fails to import is an error on the field naming it;
* ``args`` / ``kwargs`` / ``headers`` — a JSON list, object and object, whose values Celery's
  ``json`` serializer can send (no ``NaN`` or ``Infinity``, bounded depth and size: read by
  :class:`JSONInputField`);
* ``schedule_kind`` — chosen by the user (a new task's form has none chosen and no kind's
  inputs filled in); only the chosen kind's inputs are read
  (:data:`~celery_driftsafe.models.schedule_fields.KIND_INPUTS`): the others keep what the
  task has, whatever was typed into them;
* ``interval_every`` and ``interval_unit`` — a positive whole number and a unit (interval
  tasks);
* ``crontab_*`` — each field parsed on its own (``crontab_second`` is optional: empty means
  0), so two bad fields give two errors, then the combination (``0 0 31 2 *`` never fires)
  on ``crontab_day_of_month``; a whole expression typed into ``crontab_minute`` (an alias
  such as ``@daily``, five fields, or six with the seconds first) fills every field;
* ``timezone`` — an IANA zone name; a new task's starts as the Celery app's time zone
  (:func:`~celery_driftsafe.celery_app.app_time_zone`), in which Celery evaluates crontabs
  (the zone is read for every kind: the next slots are previewed in it);
* ``one_off_at`` — required for a one-off task;
* ``solar_event`` / ``solar_latitude`` / ``solar_longitude`` — an event, a latitude from -90 to
  90 and a longitude from -180 to 180 (solar tasks);
* ``valid_until`` — after ``valid_from`` when both are set; ``one_off_at`` and
  ``valid_from`` within the calendar's margins (a slot at 9999-12-31 plus its jitter
  would leave it: see :mod:`celery_driftsafe.core.validation`); ``max_runs`` — 1 or more;
  ``jitter_seconds`` — 0 to 86,400 (see :mod:`celery_driftsafe.core.bounds`);
* ``pause_after_failures`` — empty, 0 or a whole number of failures in a row (see
  :mod:`celery_driftsafe.claim.pausing`).

Saving goes through the model's ``save()``, so :mod:`celery_driftsafe.definitions.changes`
recomputes the
next slot once and wakes the beats.

The **Preview the next slots** button (:data:`PREVIEW_BUTTON`) validates the values and lists
the slots they would fire, saving nothing. An interval task that has no anchor yet is previewed
counting from the instant of the preview; the page carries that anchor (signed, in the hidden
input :data:`PREVIEW_ANCHOR`) to the form's next submit, whose save (or preview) counts from it
instead of from its own now, so the slots saved are the slots previewed.
"""

from __future__ import annotations

import json
import re
import zoneinfo
from datetime import datetime
from functools import lru_cache
from typing import Any, cast

from django import forms
from django.core import signing
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.core.validators import MinValueValidator
from django.forms.fields import InvalidJSONInput, JSONString
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from celery_driftsafe.celery_app import (
    app_time_zone,
    argument_problem,
    get_celery_app,
    load_task_modules,
    registered_task_names,
)
from celery_driftsafe.core.bounds import bound_problems
from celery_driftsafe.core.exclusions import iso_dates, parse_dates
from celery_driftsafe.core.preview import Preview
from celery_driftsafe.core.schedules import Crontab, Solar
from celery_driftsafe.core.validation import loads_json, pause_problems
from celery_driftsafe.exceptions import ClockError, ScheduleError, TaskModulesError
from celery_driftsafe.models import PeriodicTask, ScheduleKind
from celery_driftsafe.models.schedule_fields import (
    CRONTAB_FIELDS,
    EDITABLE_SCHEDULE_FIELDS,
    KIND_INPUTS,
)


@lru_cache(maxsize=1)
def time_zone_names() -> tuple[str, ...]:
    """Every IANA zone this Python knows, sorted (for the time zone suggestions)."""
    return tuple(sorted(zoneinfo.available_timezones()))


class SuggestingTextInput(forms.TextInput):
    """A text input with a ``<datalist>`` of suggestions; any text may still be typed."""

    def __init__(self, suggestions: Any = (), attrs: dict[str, Any] | None = None) -> None:
        super().__init__(attrs)
        self.suggestions = suggestions

    def render(
        self, name: str, value: Any, attrs: dict[str, Any] | None = None, renderer: Any = None
    ) -> SafeString:
        list_id = f"{(attrs or {}).get('id') or 'id_' + name}_suggestions"
        attrs = {**(attrs or {}), "list": list_id, "autocomplete": "off"}
        suggestions = self.suggestions() if callable(self.suggestions) else self.suggestions
        options = format_html_join("", '<option value="{}">', ((s,) for s in suggestions))
        return format_html(
            '{}<datalist id="{}">{}</datalist>',
            super().render(name, value, attrs, renderer),
            list_id,
            options,
        )


class JSONInputField(forms.JSONField):
    """Django's JSON form field, reading the typed text with
    :func:`~celery_driftsafe.core.validation.loads_json`: ``NaN``, ``Infinity``, ``1e999``, text
    nested past :data:`~celery_driftsafe.core.validation.MAX_JSON_DEPTH` levels or a number too long
    for Python are an error on the field, not a server error, and the text typed is shown
    again as it was."""

    def to_python(self, value: Any) -> Any:
        if self.disabled or value in self.empty_values or not isinstance(value, str):
            return super().to_python(value)
        try:
            converted = loads_json(value)
        except json.JSONDecodeError:
            raise forms.ValidationError(
                self.error_messages["invalid"], code="invalid", params={"value": value}
            ) from None
        except ValueError as exc:
            raise forms.ValidationError(
                f"This JSON cannot be sent with a task: it {exc}.", code="invalid"
            ) from None
        return JSONString(converted) if isinstance(converted, str) else converted

    def bound_data(self, data: Any, initial: Any) -> Any:
        if self.disabled or data is None:
            return super().bound_data(data, initial)
        try:
            return loads_json(data)
        except ValueError:
            return InvalidJSONInput(data)


class DatesField(forms.CharField):
    """A list of dates typed one a line or separated by commas (``2026-12-25, 2026-12-26``),
    stored as sorted ISO texts; every entry that is no date is named in one error."""

    widget = forms.Textarea(attrs={"rows": 3, "cols": 40})

    def __init__(self, *, encoder: Any = None, decoder: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # a JSONField's form field is offered its encoder: unused

    def prepare_value(self, value: Any) -> Any:
        if isinstance(value, list | tuple):
            return "\n".join(str(item) for item in value)
        return value

    def to_python(self, value: Any) -> list[str]:  # type: ignore[override]
        if isinstance(value, list | tuple):
            entries = [str(item) for item in value]
        else:
            entries = re.split(r"[\s,;]+", str(value or "").strip())
        entries = [entry for entry in entries if entry]
        dates, problems = parse_dates(entries, "dates")
        if problems:
            raise ValidationError(
                f"{problems[0].message} (one date a line, or separated by commas)",
                code="invalid",
            )
        return iso_dates(dates)

    def has_changed(self, initial: Any, data: Any) -> bool:
        try:
            return self.to_python(data) != self.to_python(initial or [])
        except ValidationError:
            return True


def _task_suggestions() -> list[str]:
    """The tasks of the app's task modules; with a module that fails to import, those
    registered before it (validation names the module)."""
    try:
        app = get_celery_app()
    except Exception:  # a broken app setting is reported by validation, not by rendering
        return []
    try:
        return registered_task_names(app)
    except TaskModulesError:
        pass
    except Exception:
        return []
    try:
        return registered_task_names(app, load=False)
    except Exception:
        return []


def _message(exc: ScheduleError) -> str:
    """The error text without the ``"field: "`` prefix (the form shows it on the field)."""
    text = str(exc)
    return text.removeprefix(f"{exc.field}: ")


#: What the scheduler switches on its own (a finished task, a broken row): a form writes it
#: only when the user changed it from what the form showed.
SWITCH = ("enabled", "disabled_reason")


#: The schedule kinds as the form offers them, each saying what it is.
KIND_LABELS: dict[str, str] = {
    ScheduleKind.INTERVAL: "Interval: every N seconds, minutes, hours or days",
    ScheduleKind.CRONTAB: "Crontab: at the times cron fields name, in a time zone",
    ScheduleKind.ONE_OFF: "One-off: once, at one instant",
    ScheduleKind.SOLAR: "Solar: at sunrise, sunset or another event of the sun, at a place",
}

#: The submit button that previews the next slots of the values in the form instead of saving.
PREVIEW_BUTTON = "_driftsafe_preview"
#: How many slots a preview lists.
PREVIEW_COUNT = 10
#: The hidden input of a preview's page that carries the interval anchor the preview counted
#: from (signed) to the form's next submit.
PREVIEW_ANCHOR = "_driftsafe_preview_anchor"
#: The salt of that signature: a value signed for anything else is not an anchor.
_ANCHOR_SALT = "celery_driftsafe.admin.forms.preview-anchor"


class PeriodicTaskForm(forms.ModelForm):  # type: ignore[type-arg]
    """Add / change form of :class:`PeriodicTask` (see the module docstring)."""

    #: The next slots of the values in the form, once a preview of valid values is computed.
    preview: Preview | None = None
    #: The interval anchor a preview counted from, for a task that has none stored: carried
    #: from the preview's page, or chosen by this form's preview (see the module docstring).
    previewed_anchor: datetime | None = None

    class Meta:
        model = PeriodicTask
        fields = [
            "name",
            "description",
            "task",
            "args",
            "kwargs",
            "enabled",
            "disabled_reason",
            *EDITABLE_SCHEDULE_FIELDS,
            "valid_from",
            "valid_until",
            "run_once",
            "max_runs",
            "jitter_seconds",
            "excluded_dates",
            "calendars",
            "misfire_policy",
            "misfire_grace_seconds",
            "overlap_policy",
            "deadline_seconds",
            "pause_after_failures",
            "queue",
            "exchange",
            "routing_key",
            "priority",
            "expires_seconds",
            "headers",
        ]
        field_classes = {
            **{name: JSONInputField for name in ("args", "kwargs", "headers")},
            "excluded_dates": DatesField,
        }
        widgets = {
            "task": SuggestingTextInput(_task_suggestions, attrs={"size": 60}),
            "timezone": SuggestingTextInput(time_zone_names),
            "args": forms.Textarea(attrs={"rows": 2, "cols": 60}),
            "kwargs": forms.Textarea(attrs={"rows": 2, "cols": 60}),
            "headers": forms.Textarea(attrs={"rows": 2, "cols": 60}),
            "disabled_reason": forms.Textarea(attrs={"rows": 2, "cols": 60}),
            "description": forms.Textarea(attrs={"rows": 2, "cols": 60}),
        }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if "interval_every" not in self.fields:  # a view-only user: every field is read-only
            return
        every = self.fields["interval_every"]
        assert isinstance(every, forms.IntegerField)
        # Our own message for 0 and below (in clean()), not "greater than or equal to 0".
        every.min_value = None
        every.validators = [v for v in every.validators if not isinstance(v, MinValueValidator)]
        every.widget.attrs.pop("min", None)
        # Our own messages for max runs below 1, a negative jitter (in clean()) and a negative
        # pause_after_failures (the model's validation).
        for name in ("max_runs", "jitter_seconds", "pause_after_failures"):
            number = self.fields[name]
            assert isinstance(number, forms.IntegerField | forms.FloatField)
            number.min_value = None
            number.validators = [
                v for v in number.validators if not isinstance(v, MinValueValidator)
            ]
            number.widget.attrs.pop("min", None)
        kind = self.fields["schedule_kind"]
        assert isinstance(kind, forms.ChoiceField)
        offered = cast("list[tuple[str, str]]", list(kind.choices))  # type: ignore[arg-type]
        kind.choices = [(value, KIND_LABELS.get(value, label)) for value, label in offered]
        kind.error_messages["required"] = (
            "Choose how the task is scheduled: interval, crontab, one-off or solar."
        )
        if self.instance._state.adding:
            given = kwargs.get("initial") or {}
            # Nothing of a kind is filled in before the kind is chosen: no crontab that fires
            # every minute, no unit (the model's defaults, still what a task of another kind
            # keeps in these fields).
            for name in (*CRONTAB_FIELDS, "interval_unit"):
                if name not in given:
                    self.initial[name] = ""
            if "timezone" not in given:
                # A new crontab's zone: the Celery app's, as Celery's own beat would use it.
                self.initial["timezone"] = app_time_zone()
        # The switch as shown travels with the form, so that a form opened before the
        # scheduler disabled the task (it finished, say) does not switch it back on unasked.
        for name in SWITCH:
            self.fields[name].show_hidden_initial = True

    @property
    def previewing(self) -> bool:
        """The form was submitted with the preview button: it is to be shown, never saved."""
        return self.is_bound and PREVIEW_BUTTON in self.data

    def is_valid(self) -> bool:
        """Valid, and to be saved. A preview is never saved: for valid values it computes
        :attr:`preview` and answers False without an error, so that the admin renders the
        form again as typed, with the slots, and writes nothing; a schedule whose slots
        cannot be computed is an error of the form."""
        valid = super().is_valid()
        if not (valid and self.previewing):
            return valid
        if self.preview is None:
            from celery_driftsafe.definitions.changes import preview

            # The reading of the authority's now that saving would use (see clean()).
            now = getattr(self.instance, "driftsafe_now", None)
            try:
                if now is None:
                    raise ValueError("the time authority's now was not read")
                self.preview = preview(self.instance, now, count=PREVIEW_COUNT)
            except (ScheduleError, OverflowError, ValueError) as exc:
                self.add_error(None, f"The next slots cannot be computed: {exc}")
            else:
                self.previewed_anchor = self.previewed_anchor or self.preview.anchor
        return False

    @property
    def previewed_anchor_token(self) -> str | None:
        """What the page carries to the next submit (:data:`PREVIEW_ANCHOR`): the anchor these
        values count from, signed, or the one this submit carried (kept through a submit with
        errors, or values that do not use it); None: nothing to carry."""
        if self.previewed_anchor is not None:
            return signing.dumps(self.previewed_anchor.isoformat(), salt=_ANCHOR_SALT)
        return None if self._carried_anchor() is None else str(self.data.get(PREVIEW_ANCHOR))

    def _carried_anchor(self) -> datetime | None:
        """The anchor the submit carries from a preview's page: a value signed here for an
        aware instant, else None (a value not signed here is not an anchor a preview took)."""
        token = self.data.get(PREVIEW_ANCHOR) if self.is_bound else None
        if not token:
            return None
        try:
            anchor = datetime.fromisoformat(signing.loads(token, salt=_ANCHOR_SALT))
        except (signing.BadSignature, TypeError, ValueError):
            return None
        return anchor if anchor.tzinfo is not None else None

    # -- single fields ----------------------------------------------------------------------

    def clean_task(self) -> str:
        name = str(self.cleaned_data.get("task") or "").strip()
        if not name:
            raise forms.ValidationError("Enter the name of a registered Celery task.")
        try:
            app = load_task_modules(get_celery_app())
            known = name in app.tasks
        except TaskModulesError as exc:
            raise forms.ValidationError(
                f"The task name cannot be checked: {exc}. Fix that module (a worker or beat "
                "would not start with it either); nothing was saved."
            ) from exc
        except Exception as exc:
            raise forms.ValidationError(
                f"The Celery app could not be loaded to check the task name: {exc}"
            ) from exc
        if not known:
            raise forms.ValidationError(
                f"{name!r} is not a task registered with the Celery app {app.main!r}. Check "
                "the spelling, or make sure the module defining it is one the app's worker "
                "imports (found by autodiscover_tasks, or in its imports: CELERY_IMPORTS)."
            )
        return name

    def clean_args(self) -> Any:
        value = self.cleaned_data.get("args")
        if value is None:
            return []
        if not isinstance(value, list):
            raise forms.ValidationError('Arguments must be a JSON list, e.g. [1, "a"].')
        return value

    def clean_kwargs(self) -> Any:
        value = self.cleaned_data.get("kwargs")
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise forms.ValidationError('Keyword arguments must be a JSON object, e.g. {"a": 1}.')
        return value

    def clean_headers(self) -> Any:
        value = self.cleaned_data.get("headers")
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise forms.ValidationError('Headers must be a JSON object, e.g. {"x-team": "ops"}.')
        return value

    def clean_timezone(self) -> str:
        name = str(self.cleaned_data.get("timezone") or "").strip()
        try:
            Crontab(timezone=name)
        except ScheduleError as exc:
            raise forms.ValidationError(_message(exc)) from exc
        return name

    def _clean_arguments(self, data: dict[str, Any]) -> None:
        """The arguments fit the task's signature, as Celery checks them when a slot is
        published (a save that passed would fail every slot from then on)."""
        if any(name in self.errors for name in ("task", "args", "kwargs")):
            return
        problem = argument_problem(
            get_celery_app(), data.get("task", ""), data.get("args", []), data.get("kwargs", {})
        )
        if problem:
            self.add_error("kwargs" if "keyword argument" in problem else "args", problem)

    # -- the schedule as a whole -----------------------------------------------------------

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        if self.instance.pk is not None:
            for name in SWITCH:  # left as shown: what the task has now (read for this POST)
                if name in data and name not in self.changed_data:
                    data[name] = getattr(self.instance, name)
        if "calendars" in self.fields and "calendars" not in self.errors:
            from celery_driftsafe.definitions.calendars import exclusions_of

            # The calendars chosen, as saving them copies them to the task (its validation
            # and the preview see them; the save of a stored task keeps the stored copy until
            # the calendars are saved, just after it).
            self.instance.calendar_exclusions = exclusions_of(data.get("calendars") or ())
        kind = data.get("schedule_kind")
        self._ignore_other_kinds(kind, data)
        if kind == ScheduleKind.INTERVAL:
            every = data.get("interval_every")
            if "interval_every" not in self.errors and (every is None or every <= 0):
                self.add_error(
                    "interval_every", "An interval must be a positive whole number, e.g. 30."
                )
            if "interval_unit" not in self.errors and not data.get("interval_unit"):
                self.add_error("interval_unit", "Choose the unit of the interval.")
        elif kind == ScheduleKind.CRONTAB:
            self._clean_crontab(data)
        elif (
            kind == ScheduleKind.ONE_OFF
            and data.get("one_off_at") is None
            and "one_off_at" not in self.errors
        ):
            self.add_error("one_off_at", "A one-off task needs the instant it runs at.")
        elif kind == ScheduleKind.SOLAR:
            self._clean_solar(data)
        self._clean_bounds(data)
        self._clean_arguments(data)
        if not self.errors:
            self._read_the_authority()
            self._count_from_the_previewed_anchor(data)
        return data

    def _count_from_the_previewed_anchor(self, data: dict[str, Any]) -> None:
        """An interval task that gets its anchor at this save counts its slots from the anchor
        the preview before it counted from (carried by the page, :data:`PREVIEW_ANCHOR`), so
        that the slots saved are those previewed. Only where the save would choose the anchor
        (an interval, no anchor stored, no ``valid_from``), and only an instant a preview
        could have taken: not after the authority's now (the save then counts from its own
        now, as without a preview)."""
        anchor = self._carried_anchor()
        now = getattr(self.instance, "driftsafe_now", None)
        if (
            anchor is None
            or now is None
            or anchor > now
            or data.get("schedule_kind") != ScheduleKind.INTERVAL
            or data.get("valid_from") is not None
            or self.instance.interval_anchor is not None
        ):
            return
        self.instance.interval_anchor = self.previewed_anchor = anchor

    def _ignore_other_kinds(self, kind: str | None, data: dict[str, Any]) -> None:
        """The inputs of the kinds not chosen are not read (a page without JavaScript shows
        them all): they keep what the task has (a new task: the model's defaults), and what
        was typed into them is no error."""
        for other, names in KIND_INPUTS.items():
            if other == kind:
                continue
            for name in names:
                if name in self.fields:
                    self.errors.pop(name, None)
                    data[name] = getattr(self.instance, name)

    def _read_the_authority(self) -> None:
        """Saving computes the next slot from the time authority's now: read it here, so that
        an authority out of reach (Redis down with ``TIME_AUTHORITY = "redis"``) is a form
        error that keeps what was typed, not a server error at the save; the save then uses
        this reading."""
        from celery_driftsafe.definitions.changes import authority_now

        try:
            self.instance.driftsafe_now = authority_now()
        except ClockError as exc:
            raise forms.ValidationError(
                "The time authority cannot be read, so the task's next slot cannot be "
                f"computed; nothing was saved. Try again once it is back ({exc}).",
                code="authority",
            ) from exc

    def _clean_bounds(self, data: dict[str, Any]) -> None:
        """Valid until after valid from, max runs of 1 or more, a jitter of 0 to a day, a
        pause after 0 (never) or more failures."""
        for problem in bound_problems(
            valid_from=data.get("valid_from"),
            valid_until=data.get("valid_until"),
            max_runs=data.get("max_runs"),
            jitter_seconds=data.get("jitter_seconds"),
        ) + pause_problems(data.get("pause_after_failures")):
            if problem.field not in self.errors:
                self.add_error(
                    problem.field, problem.message[:1].upper() + problem.message[1:] + "."
                )

    def _clean_solar(self, data: dict[str, Any]) -> None:
        missing = {
            "solar_event": "A solar task needs the event it runs at, such as sunset.",
            "solar_latitude": "A solar task needs a latitude (degrees north, -90 to 90).",
            "solar_longitude": "A solar task needs a longitude (degrees east, -180 to 180).",
        }
        for field, message in missing.items():
            if field not in self.errors and data.get(field) in (None, ""):
                self.add_error(field, message)
        # Each coordinate on its own (the event is a choice: the form field checks it).
        for field, place in (
            ("solar_latitude", (data.get("solar_latitude"), 0)),
            ("solar_longitude", (0, data.get("solar_longitude"))),
        ):
            if field in self.errors:
                continue
            try:
                Solar("solar_noon", *place)
            except ScheduleError as exc:
                self.add_error(field, _message(exc))

    def _clean_crontab(self, data: dict[str, Any]) -> None:
        if not self._expand_expression(data):
            return
        bad = False
        for field, argument in CRONTAB_FIELDS.items():
            value = str(data.get(field) or "").strip()
            if field == "crontab_second" and not value:
                value = "0"  # optional: a five-field crontab fires at second 0
            data[field] = value
            try:
                Crontab(**{argument: value})
            except ScheduleError as exc:
                self.add_error(field, _message(exc))
                bad = True
        if bad or "timezone" in self.errors:
            return
        try:  # each field is fine alone; the combination may still never fire
            Crontab(
                **{arg: data[field] for field, arg in CRONTAB_FIELDS.items()},
                timezone=data.get("timezone") or "UTC",
            )
        except ScheduleError as exc:
            field = next(
                (f for f, a in CRONTAB_FIELDS.items() if a == exc.field), "crontab_day_of_month"
            )
            self.add_error(field, _message(exc))

    def _expand_expression(self, data: dict[str, Any]) -> bool:
        """A whole expression typed into the minute field (``@daily``, ``0 3 * * *``, six
        fields with the seconds first) fills every crontab field, when the others are left empty
        or at ``*``. False when it cannot be read (the error is on ``crontab_minute``)."""
        text = str(data.get("crontab_minute") or "").strip()
        if not (text.startswith("@") or len(text.split()) > 1):
            return True
        others = [
            str(data.get(f) or "").strip()
            for f in CRONTAB_FIELDS
            if f not in ("crontab_minute", "crontab_second")
        ]
        second = str(data.get("crontab_second") or "").strip()
        if any(value not in ("", "*") for value in others) or second not in ("", "0"):
            self.add_error(
                "crontab_minute",
                "A whole expression goes in the minute field only "
                "when the other crontab fields are left empty (or at *).",
            )
            return False
        try:
            parsed = Crontab.from_expression(text)
        except ScheduleError as exc:
            self.add_error("crontab_minute", _message(exc))
            return False
        for field, argument in CRONTAB_FIELDS.items():
            data[field] = getattr(parsed, argument).strip()
        return True

    def _update_errors(self, errors: ValidationError) -> None:
        """The model's errors on fields the form does not show (the interval's anchor, set at
        save, of a row written behind ``save()``'s back) go above the fields, named, instead
        of failing the page: Django accepts errors only on the form's own fields."""
        if hasattr(errors, "error_dict"):
            shown: dict[str, Any] = {}
            for field, messages in errors.error_dict.items():
                if field == NON_FIELD_ERRORS or field in self.fields:
                    shown.setdefault(field, []).extend(messages)
                else:
                    shown.setdefault(NON_FIELD_ERRORS, []).extend(
                        ValidationError(f"{field}: {message}")
                        for error in messages
                        for message in error.messages
                    )
            errors = ValidationError(shown)
        super()._update_errors(errors)  # type: ignore[misc]  # private: not in the stubs

    def full_clean(self) -> None:
        super().full_clean()
        # The model's clean() repeats some checks with its own wording; keep one message
        # per field (ours, which came first).
        if not self.is_bound:
            return
        by_field = self.errors  # set by full_clean() above: no recursion
        for name, errors in list(by_field.items()):
            if len(errors) > 1:
                by_field[name] = self.error_class(errors[:1])
