"""``manage.py driftsafe_import``: bring periodic tasks in from Celery's ``beat_schedule`` and
from django-celery-beat's database, idempotently.

Every entry is converted and validated first; nothing is written with ``--dry-run``. Then, per
entry, by its unique name:

* absent here: **created** (its next slot computed once from the time authority);
* present and identical: **unchanged** — running the import twice changes nothing, and an
  interval's anchor is never moved;
* present and different: a ``beat_schedule`` row (source ``beat_schedule``) is **updated**, as a
  beat does at start; any other row is **kept** as it is, unless ``--update`` is given (rows
  edited in the admin are never overwritten by accident);
* not importable (bad JSON, invalid crontab, a schedule class of its own): **error**, with
  the reason; the command then exits with status 1 after importing the rest.

For every task the command prints a table of what it brought over (each option of the source
and the field that now holds it) and what it did not (with why). From django-celery-beat every
option it can store is brought over: the four schedule kinds (``clocked`` becomes a one-off
task), ``one_off`` with any of them (``run_once``), ``start_time`` (``valid_from``; an interval
also counts its slots from it), the absolute ``expires`` (``valid_until``), ``expire_seconds``,
the publish options, ``headers``, ``args``/``kwargs``, ``description``, ``enabled``, and, on
creation, ``last_run_at`` and ``total_run_count`` (``last_slot_at``, ``run_count``).

Imported django-celery-beat tasks become database-managed tasks (edit them in this admin);
``beat_schedule`` entries stay ``beat_schedule``-managed. A task name the Celery app does not
know, once its task modules are imported as a worker imports them, is imported with a warning:
the beat would record its runs as failed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.apps import apps
from django.core.management.base import BaseCommand, CommandError, CommandParser

from celery_driftsafe.celery_app import (
    argument_problem,
    get_celery_app,
    load_celery_app,
    load_task_modules,
)
from celery_driftsafe.definitions.beat_schedule import ENTRY_ERRORS, error_text
from celery_driftsafe.definitions.changes import authority_now
from celery_driftsafe.definitions.importing import (
    BEAT_SCHEDULE,
    DJANGO_CELERY_BEAT,
    Entry,
    from_beat_schedule,
    from_django_celery_beat,
)
from celery_driftsafe.definitions.upsert import Upserted, check_fields, upsert_by_name
from celery_driftsafe.exceptions import TaskModulesError
from celery_driftsafe.models import PeriodicTask, TaskSource

logger = logging.getLogger(__name__)

_NOT_COMPARED = ("interval_anchor",)


@dataclass
class Outcome:
    entry: Entry
    action: str  # create, update, unchanged, kept, error
    detail: str = ""


def _validate(entry: Entry) -> None:
    task = PeriodicTask(name=entry.name, **entry.fields, **entry.on_create)
    try:
        check_fields(task)
    except ENTRY_ERRORS as exc:
        entry.error = error_text(exc)


def plan(entries: list[Entry], *, update: bool) -> list[Outcome]:
    """Decide, without writing, what importing ``entries`` does (see the module docstring)."""
    existing = {t.name: t for t in PeriodicTask.objects.filter(name__in=[e.name for e in entries])}
    outcomes = []
    for entry in entries:
        if not entry.error:
            _validate(entry)
        if entry.error:
            outcomes.append(Outcome(entry, "error", entry.error))
            continue
        current = existing.get(entry.name)
        if current is None:
            outcomes.append(Outcome(entry, "create"))
            continue
        differing = sorted(
            k
            for k, v in entry.fields.items()
            if k not in _NOT_COMPARED and k != "source" and getattr(current, k) != v
        )
        if not differing:
            outcomes.append(Outcome(entry, "unchanged"))
        elif update or (
            entry.origin == BEAT_SCHEDULE and current.source == TaskSource.BEAT_SCHEDULE
        ):
            outcomes.append(Outcome(entry, "update", "changes " + ", ".join(differing)))
        else:
            why = (
                "it is managed in the database"
                if entry.origin == BEAT_SCHEDULE
                else "use --update to overwrite it"
            )
            outcomes.append(Outcome(entry, "kept", f"differs in {', '.join(differing)}; {why}"))
    return outcomes


def apply(outcomes: list[Outcome], now: datetime) -> None:
    """Write the creates and updates of ``outcomes``; ``now`` is one authority reading."""
    for outcome in outcomes:
        entry = outcome.entry
        if outcome.action not in ("create", "update"):
            continue
        try:
            written = upsert_by_name(
                entry.name,
                entry.fields,
                now=now,
                on_create=entry.on_create,
                create=outcome.action == "create",
                update=outcome.action == "update",
            )
        except ENTRY_ERRORS as exc:  # rolled back: nothing of this task is written
            outcome.action, outcome.detail = "error", error_text(exc)
            continue
        if written == Upserted.MISSING:
            outcome.action, outcome.detail = "error", "deleted meanwhile"
            continue
        if written == Upserted.EXISTS:
            outcome.action, outcome.detail = "unchanged", "created meanwhile"
        elif written == Upserted.UNCHANGED:
            outcome.action, outcome.detail = "unchanged", "changed to the same meanwhile"
        logger.info(
            "imported %s from %s: %s",
            entry.name,
            entry.origin,
            outcome.action,
            extra={"action": "import", "task": entry.name},
        )


class Command(BaseCommand):
    help = (
        "Import periodic tasks from Celery's beat_schedule and django-celery-beat, "
        "idempotently (see --dry-run)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--source",
            action="append",
            choices=[BEAT_SCHEDULE, DJANGO_CELERY_BEAT],
            help="import only from this source (repeatable); default: every available source",
        )
        parser.add_argument(
            "--app",
            metavar="MODULE:APP",
            help="the Celery app whose beat_schedule to import (default: the project's app)",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="show what would be done, write nothing"
        )
        parser.add_argument(
            "--update",
            action="store_true",
            help="overwrite existing tasks that differ (not only beat_schedule ones)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        sources = options["source"] or [BEAT_SCHEDULE, DJANGO_CELERY_BEAT]
        explicit = bool(options["source"])
        app = load_celery_app(options["app"]) if options["app"] else get_celery_app()
        entries: list[Entry] = []
        if BEAT_SCHEDULE in sources:
            entries += from_beat_schedule(app)
        if DJANGO_CELERY_BEAT in sources:
            if apps.is_installed("django_celery_beat"):
                entries += from_django_celery_beat()
            elif explicit:
                raise CommandError(
                    "django_celery_beat is not in INSTALLED_APPS: nothing to import from it"
                )
            else:
                self.stdout.write("django_celery_beat is not installed: skipped")
        names = [e.name for e in entries]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        registry = self._registry(app)
        for entry in entries:
            if entry.name in duplicates and not entry.error:
                entry.error = "the same name comes from more than one source"
            if registry is not None and not entry.error:
                unfit = argument_problem(
                    registry,
                    str(entry.fields.get("task") or ""),
                    entry.fields.get("args") or [],
                    entry.fields.get("kwargs") or {},
                )
                if unfit:
                    entry.error = f"args: {unfit}"
        outcomes = plan(entries, update=options["update"])
        if not options["dry_run"]:
            apply(outcomes, authority_now())
        self._report(outcomes, registry, dry_run=options["dry_run"])
        errors = sum(1 for o in outcomes if o.action == "error")
        if errors:
            raise CommandError(f"{errors} task(s) could not be imported (see above)")

    def _registry(self, app: Any) -> Any:
        """``app`` with its task modules imported, as a worker has it (the task names and
        signatures checked against it), or None (said) when they cannot be imported."""
        try:
            return load_task_modules(app)
        except TaskModulesError as exc:
            self.stdout.write(
                self.style.WARNING(f"warning: task names and arguments not checked: {exc}")
            )
        except Exception:  # an app that cannot finalise: no registry checks
            pass
        return None

    def _report(self, outcomes: list[Outcome], registry: Any, *, dry_run: bool) -> None:
        verb = {"create": "would create", "update": "would update"} if dry_run else {}
        known: Any = registry.tasks if registry is not None else None
        counts: dict[str, int] = {}
        for outcome in outcomes:
            entry = outcome.entry
            counts[outcome.action] = counts.get(outcome.action, 0) + 1
            style = self.style.ERROR if outcome.action == "error" else (lambda s: s)
            line = f"{verb.get(outcome.action, outcome.action):<12} {entry.name} ({entry.origin})"
            if outcome.detail:
                line += f": {outcome.detail}"
            self.stdout.write(style(line))
            task = entry.fields.get("task")
            if known is not None and task and outcome.action != "error" and task not in known:
                self.stdout.write(
                    self.style.WARNING(
                        f"  warning: task {task!r} is not registered with the Celery app"
                    )
                )
            for note in entry.notes:
                self.stdout.write(f"  note: {note}")
            if outcome.action != "error":
                self._table(entry)
        summary = ", ".join(f"{n} {a}" for a, n in sorted(counts.items())) or "nothing to import"
        self.stdout.write(("dry run, nothing written: " if dry_run else "") + summary)

    def _table(self, entry: Entry) -> None:
        """What was brought over and what was not, one row per option of the source."""
        rows = [(option, held, "") for option, held in entry.carried]
        rows += [(option, "", f"NOT brought over: {why}") for option, why in entry.dropped]
        width = max([len("option"), *(len(r[0]) for r in rows)])
        held_width = max([len("brought over as"), *(len(r[1]) for r in rows)])
        self.stdout.write(
            f"  | {'option':<{width}} | {'brought over as':<{held_width}} | not brought over"
        )
        for option, held, why in rows:
            self.stdout.write(
                f"  | {option:<{width}} | {held:<{held_width}} | "
                f"{why.removeprefix('NOT brought over: ') or '-'}"
            )
        if not entry.dropped:
            self.stdout.write("  everything was brought over")
