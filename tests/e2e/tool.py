"""Run inside the e2e database's settings: ``python -m tests.e2e.tool <command>``.

Commands: migrate, calendars, seed, add, preview_and_add, update, delete, make_run, run,
stale_saves, corrupt, dump; and ``serve``, which answers commands one after the other in one
process (:func:`serve`).

``seed`` reads a JSON list of task specs on stdin (``calendars``: names of calendars made by
``calendars`` before) and sets each task's first slot to the first slot at or after ``start``;
``preview_and_add`` previews a new task as the admin's button does and saves it as the admin's
form then does (with the preview's anchor), printing the preview;
``dump`` prints tasks, runs and nodes as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.e2e.settings")


def main(command: str) -> None:
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import transaction

    from celery_driftsafe.models import BeatNode, PeriodicTask, Run, RunAttempt

    if command == "migrate":
        call_command("migrate", verbosity=0, interactive=False)
    elif command == "calendars":  # JSON list of Calendar fields
        from celery_driftsafe.models import Calendar

        for spec in json.load(sys.stdin):
            Calendar.objects.create(**spec)
    elif command == "seed":
        from celery_driftsafe.models import Calendar

        for spec in json.load(sys.stdin):
            start = datetime.fromisoformat(spec.pop("start"))
            calendars = spec.pop("calendars", [])
            task = PeriodicTask(**{"task": "e2e.tick", **spec})
            task.driftsafe_now = start  # type: ignore[attr-defined]
            task.full_clean(exclude=["interval_anchor"])
            # one transaction: the beats run while tasks are seeded, and one that claimed
            # the new row between the two writes made the second fail at repeatable read
            # (or set it back after the claim)
            with transaction.atomic():
                task.save()
                if calendars:  # linked by name: their exclusions copied into the row
                    task.calendars.set(Calendar.objects.filter(name__in=calendars))
                    task.refresh_from_db()
                PeriodicTask.objects.filter(pk=task.pk).update(
                    next_slot_at=task.schedule.first_at_or_after(start)
                )
    elif command == "add":  # like the admin would: the authority decides the first slot
        for spec in json.load(sys.stdin):
            task = PeriodicTask(task="e2e.tick", **spec)
            task.full_clean(exclude=["interval_anchor"])
            task.save()
    elif command == "preview_and_add":  # as the admin's preview, then its save
        from celery_driftsafe.definitions import changes

        spec = json.load(sys.stdin)
        names = spec.pop("names")
        for name in names:  # the first name whose preview holds a slot behind the one before
            task = PeriodicTask(task="e2e.tick", name=name, **spec)
            task.full_clean(exclude=["interval_anchor"])
            now = changes.authority_now()
            preview = changes.preview(task, now, count=spec.get("max_runs") or 10)
            if any(row.held for row in preview.rows):
                break
        # the page hands the preview's anchor to the save (admin/forms.py)
        task.interval_anchor = preview.anchor
        task.save()
        json.dump(
            {
                "name": task.name,
                "previewed_at": now.isoformat(),
                "anchor": task.interval_anchor.isoformat(),
                "next_slot": task.next_slot_at.isoformat() if task.next_slot_at else None,
                "rows": [
                    {
                        "slot": row.slot.isoformat(),
                        "due": row.due.isoformat(),
                        "fires_at": row.fires_at.isoformat(),
                        "held": row.held,
                    }
                    for row in preview.rows
                ],
            },
            sys.stdout,
        )
    elif command == "update":
        change = json.load(sys.stdin)
        task = PeriodicTask.objects.get(name=change["name"])
        for key, value in change["fields"].items():
            setattr(task, key, value)
        task.full_clean()
        task.save()
    elif command == "delete":
        PeriodicTask.objects.get(name=json.load(sys.stdin)["name"]).delete()
    elif command == "make_run":  # a manual run, as the admin's "run now" creates one
        import uuid

        from celery_driftsafe.models import RunKind, RunStatus

        run = Run.objects.create(
            kind=RunKind.MANUAL,
            task_name=json.load(sys.stdin)["task"],
            status=RunStatus.DISPATCHED,
            celery_task_id=str(uuid.uuid4()),
        )
        json.dump({"id": run.pk, "celery_task_id": run.celery_task_id}, sys.stdout)
    elif command == "run":
        run = Run.objects.get(pk=json.load(sys.stdin)["id"])
        json.dump(
            {
                "status": run.status,
                "fencing_token": run.fencing_token,
                "worker": run.worker,
                "duplicates": run.duplicate_deliveries,
                "error": run.error,
            },
            sys.stdout,
        )
    elif command == "stale_saves":  # save from instances read a while ago, as forms do
        stale_saves(**json.load(sys.stdin))
    elif command == "corrupt":  # raw SQL, as a data migration or a psql session would
        from django.db import connection

        table = PeriodicTask._meta.db_table
        with connection.cursor() as cursor:
            for change in json.load(sys.stdin):
                cursor.execute(
                    f"UPDATE {table} SET {change['set']} WHERE name = %s", [change["name"]]
                )
    elif command == "dump":

        def iso(value: datetime | None) -> str | None:
            return value.isoformat() if value else None

        tasks = [
            {
                "id": t.pk,
                "name": t.name,
                "kind": t.schedule_kind,
                "every": t.interval_every,
                "anchor": iso(t.interval_anchor),
                "minute": t.crontab_minute,
                "hour": t.crontab_hour,
                "timezone": t.timezone,
                "source": t.source,
                "enabled": t.enabled,
                "disabled_reason": t.disabled_reason,
                "stale_since": iso(t.stale_since),
                "consecutive_failures": t.consecutive_failures,
            }
            for t in PeriodicTask.objects.all()
        ]
        attempt_rows: dict[int, list[list[Any]]] = {}
        for a in RunAttempt.objects.order_by("run_id", "number"):
            attempt_rows.setdefault(a.run_id, []).append([a.number, a.outcome])
        runs = [
            {
                "task_id": r.periodic_task_id,
                "slot": iso(r.slot),
                "status": r.status,
                "celery_task_id": r.celery_task_id,
                "attempts": r.dispatch_attempts,
                "claimed_by": r.claimed_by,
                "run_kind": r.kind,
                "claimed_at": iso(r.claimed_at),
                "dispatched_at": iso(r.dispatched_at),
                "started": iso(r.started_at),
                "worker": r.worker,
                "finished": iso(r.finished_at),
                "error": r.error,
                "id": r.pk,
                "attempt": r.attempt,
                "missed_count": r.missed_count,
                "missed_until": iso(r.missed_until),
                "late_at": iso(r.late_at),
                "attempt_rows": attempt_rows.get(r.pk, []),
                "replaced_by": r.replaced_by,
            }
            for r in Run.objects.all()
        ]
        nodes = [
            {
                "node_id": n.node_id,
                "offset": n.clock_offset_seconds,
                "rtt": n.clock_rtt_seconds,
                "stopped": iso(n.stopped_at),
                "claiming_since": iso(n.claiming_since),
            }
            for n in BeatNode.objects.all()
        ]
        json.dump({"tasks": tasks, "runs": runs, "nodes": nodes}, sys.stdout)
    else:
        raise SystemExit(f"unknown command {command!r}: use migrate, seed or dump")


def stale_saves(name: str, seconds: float, pause: float) -> None:
    """For ``seconds``: load the task, wait ``pause`` (the claims move on meanwhile), change its
    kwargs and save the stale instance: through the ORM and, every other time, through the
    admin's form, as a person editing it would."""
    import time

    from django.forms.models import model_to_dict

    from celery_driftsafe.admin.forms import PeriodicTaskForm
    from celery_driftsafe.models import PeriodicTask

    deadline = time.monotonic() + seconds
    saves = 0
    while time.monotonic() < deadline:
        stale = PeriodicTask.objects.get(name=name)
        time.sleep(pause)
        if saves % 2:
            data = {k: v for k, v in model_to_dict(stale).items() if v is not None}
            data.update(
                args=json.dumps(stale.args),
                kwargs=json.dumps({"save": saves}),
                headers=json.dumps(stale.headers),
            )
            form = PeriodicTaskForm(data=data, instance=stale)
            if not form.is_valid():
                raise SystemExit(f"the admin form refused the edit: {form.errors.as_json()}")
            form.save()
        else:
            stale.kwargs = {"save": saves}
            stale.save()
        saves += 1
    json.dump({"saves": saves}, sys.stdout)


def serve() -> None:
    """Answer commands until stdin ends, one a line: ``{"command": ..., "payload": ...}`` in,
    ``{"ok": ..., "out": ..., "error": ...}`` out (``out``: what the command printed). One
    process for a run's many looks (``dump``, ``run``): a look is then milliseconds, where a
    process of its own took about a second of CPU, which the tests' polling loops spent again
    and again beside the beats and workers they watch on two shared cores. The connections are
    closed after each command, so a database restarted in between is met afresh."""
    import io
    import traceback

    from django.db import connections

    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever else writes to stdout goes to stderr, not into the answers
    for line in sys.stdin:
        request = json.loads(line)
        payload = request.get("payload")
        sys.stdin = io.StringIO(json.dumps(payload) if payload is not None else "")
        sys.stdout = printed = io.StringIO()
        try:
            main(request["command"])
            answer = {"ok": True, "out": printed.getvalue()}
        except BaseException:  # SystemExit too: the caller raises it
            answer = {"ok": False, "error": traceback.format_exc()}
        finally:
            sys.stdin, sys.stdout = sys.__stdin__, sys.__stdout__
            connections.close_all()
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve()
    else:
        main(sys.argv[1])
