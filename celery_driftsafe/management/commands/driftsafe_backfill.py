"""``manage.py driftsafe_backfill``: run the slots of a task's schedule in a past range, each at
most once (see :mod:`celery_driftsafe.publish.backfill`).

Exit status: 0 when done (also when every slot had a run already), 1 on errors (an unknown
task, a bad range or instant, more slots than ``BACKFILL_MAX_SLOTS``), 2 when some runs could
not be published (they stay ``claimed``, and a beat's outbox publishes them).
"""

from __future__ import annotations

import re
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from celery_driftsafe.exceptions import BackfillRefused, ScheduleError, TaskRefused
from celery_driftsafe.models import PeriodicTask
from celery_driftsafe.publish.backfill import (
    BackfillResult,
    parse_instant,
    plan_backfill,
    run_backfill,
)

#: ``--rate``: runs per second, minute or hour.
RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(s|m|h)\s*$")
PER = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_rate(text: str) -> float:
    """``"N/s"``, ``"N/m"`` or ``"N/h"`` as runs per second."""
    match = RATE.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise CommandError(f"--rate {text!r}: give a positive number of runs per s, m or h: 10/s")
    return float(match.group(1)) / PER[match.group(2)]


class Command(BaseCommand):
    help = (
        "Run the slots of a periodic task's schedule from --from (included) to --to (excluded) "
        "that have no run yet, each at most once, also while beats or other backfills run."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--task", required=True, metavar="NAME", help="the task's name")
        for option, what in (("--from", "first instant (included)"), ("--to", "end (excluded)")):
            parser.add_argument(
                option,
                required=True,
                metavar="INSTANT",
                dest=option[2:] + "_",
                help=f"{what}: ISO 8601, e.g. 2026-03-01T00:00:00Z; an instant without an "
                "offset is read in the task's time zone",
            )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="list the slots it would run and skip; write nothing",
        )
        parser.add_argument(
            "--rate",
            default=None,
            metavar="N/s",
            help="publish at most N runs per second (or N/m, N/h); default: as fast as the broker "
            "takes them",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        rate = None if options["rate"] is None else parse_rate(options["rate"])
        task = PeriodicTask.objects.filter(name=options["task"]).first()
        if task is None:
            raise CommandError(_unknown_task(options["task"]))
        try:
            start = parse_instant(options["from_"], task.timezone)
            end = parse_instant(options["to_"], task.timezone)
        except ValueError as exc:
            raise CommandError(f"--from/--to: {exc}") from exc
        try:
            plan = plan_backfill(task, start, end)
        except (BackfillRefused, TaskRefused, ScheduleError) as exc:
            raise CommandError(str(exc)) from exc
        write = self.stdout.write
        write(
            f"{task.name}: {len(plan.to_run)} slots to run, {len(plan.taken)} skipped (they have "
            f"a run), from {start.isoformat()} to {end.isoformat()}"
        )
        for slot in plan.to_run:
            write(f"  run   {slot.isoformat()}")
        for taken in plan.taken:
            write(
                f"  skip  {taken.slot.isoformat()}  run #{taken.run_id} "
                f"({taken.kind}, {taken.status})"
            )
        if options["dry_run"]:
            write("dry run: nothing written")
            return

        def progress(result: BackfillResult) -> None:
            if options["verbosity"] > 1:
                write(f"  ... {result.published} published")

        result = run_backfill(plan, rate=rate, progress=progress)
        write(
            f"inserted {result.inserted} runs, published {result.published}; "
            f"{result.lost} slots were taken meanwhile by a beat or another backfill"
        )
        if result.unpublished:
            for run_id, reason in sorted(result.unpublished.items()):
                self.stderr.write(f"  run #{run_id} not published: {reason}")
            raise CommandError(
                f"{len(result.unpublished)} runs not published (see above)", returncode=2
            )


def _unknown_task(name: str) -> str:
    """The error for a task name no periodic task has: the names closest to it, if any."""
    import difflib

    names = list(PeriodicTask.objects.values_list("name", flat=True))
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    if close:
        return (
            f"no periodic task named {name!r}; did you mean "
            + " or ".join(repr(found) for found in close)
            + "?"
        )
    return (
        f"no periodic task named {name!r} (of {len(names)}; the admin's periodic task list "
        "shows their names)"
    )
