"""``manage.py driftsafe_prune``: delete finished runs past their retention, in small batches
(see :mod:`celery_driftsafe.ledger.retention`), for projects that prune from cron rather than from
the
beats (``PRUNE_INTERVAL_SECONDS = None``).

Exit status: 0 when done (also when retention is off), 1 on errors (for example an unreachable
time authority).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from celery_driftsafe.conf import get_settings
from celery_driftsafe.exceptions import ClockError, ConfigurationError
from celery_driftsafe.ledger.retention import Pruner


class Command(BaseCommand):
    help = "Delete finished runs older than RUN_RETENTION_SECONDS / FAILED_RUN_RETENTION_SECONDS."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--dry-run", action="store_true", help="count what would be deleted; delete nothing"
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            default=None,
            metavar="N",
            help="runs per statement (default: PRUNE_BATCH_SIZE)",
        )
        parser.add_argument(
            "--max-batches",
            type=int,
            default=None,
            metavar="N",
            help="stop after N batches (default: until nothing is left)",
        )
        parser.add_argument(
            "--pause",
            type=float,
            default=None,
            metavar="SECONDS",
            help="pause between batches (default: from PRUNE_DUTY_CYCLE, three times as long as "
            "a batch took at the default 0.25)",
        )
        parser.add_argument("--json", action="store_true", help="print one JSON document")

    def handle(self, *args: Any, **options: Any) -> None:
        from celery_driftsafe.store.clock import authority_from_settings

        for name in ("batch_size", "max_batches"):
            if options[name] is not None and options[name] < 1:
                raise CommandError(f"--{name.replace('_', '-')} must be at least 1")
        if options["pause"] is not None and options["pause"] < 0:
            raise CommandError("--pause must be >= 0")
        settings = get_settings()
        try:
            now = authority_from_settings(settings).read()
        except (ClockError, ConfigurationError) as exc:
            raise CommandError(f"cannot read the time authority: {exc}") from exc
        pruner = Pruner(settings, batch_size=options["batch_size"])
        cutoffs = {status: cutoff.isoformat() for status, cutoff in pruner.retention.cutoffs(now)}
        report: dict[str, Any] = {
            "now": now.isoformat(),
            "dry_run": options["dry_run"],
            "cutoffs": cutoffs,
        }
        if options["dry_run"]:
            report["would_delete"] = pruner.pending(now)
        else:
            done = pruner.prune(now, max_batches=options["max_batches"], pause=options["pause"])
            report["deleted"] = asdict(done)
        if options["json"]:
            self.stdout.write(json.dumps(report, indent=2))
            return
        self._print(report)

    def _print(self, report: dict[str, Any]) -> None:
        out = self.stdout.write
        if not report["cutoffs"]:
            out(
                "retention is off (RUN_RETENTION_SECONDS and FAILED_RUN_RETENTION_SECONDS are "
                "None): nothing to prune"
            )
            return
        out(f"time authority now: {report['now']}")
        for status, cutoff in report["cutoffs"].items():
            out(f"  {status:<10} runs claimed before {cutoff}")
        if report["dry_run"]:
            counts = report["would_delete"]
            out(
                f"dry run: would delete {sum(counts.values())} runs "
                + ", ".join(f"{status} {count}" for status, count in counts.items())
            )
            return
        done = report["deleted"]
        by_status = ", ".join(f"{s} {n}" for s, n in sorted(done["by_status"].items()))
        out(
            f"deleted {done['runs']} runs{f' ({by_status})' if by_status else ''}, "
            f"{done['attempts']} attempts, {done['lock_rows']} lock rows, {done['fences']} "
            f"fencing counters in {done['batches']} batches, {done['seconds']:.2f} s of "
            "statements"
        )
