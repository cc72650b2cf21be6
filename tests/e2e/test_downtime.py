"""End-to-end: a real ``celery beat`` starting after eight minutes in which no beat ran. The
ledger accounts for every slot of the downtime exactly, as the misfire policies say
(``celery_driftsafe/core/misfire.py``): a ``fire_once`` task fires its latest missed slot and
no other, a ``fire_all`` task its latest ``FIRE_ALL_MAX`` missed slots, a ``skip`` task whose
latest missed slot is past its grace none; every other slot of the downtime is recorded
missed (beyond ``RECORD_MAX`` slots, in one summary row: first, last, count); and from the
first claim on every slot fires, once.
"""

from __future__ import annotations

import inspect
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from celery_driftsafe.conf import DriftSafeSettings
from celery_driftsafe.core.misfire import plan_claim
from tests import settings as test_settings
from tests.e2e.harness import E2ERun, real_now, schedule_of

pytestmark = [pytest.mark.e2e]

BACKEND = "postgresql" if test_settings.TEST_DB == "postgres" else "sqlite"
#: The beats' bound on a ``fire_all`` task's catch-up runs (the package's default).
FIRE_ALL_MAX = DriftSafeSettings.fire_all_max
#: The most missed slots a claim records a row each; more are one summary row.
RECORD_MAX: int = inspect.signature(plan_claim).parameters["record_max"].default
#: The ``skip`` task's grace: its latest missed slot fires only when it is this recent.
SKIP_GRACE = 30.0


def _catch_up(policy: str, missed: list[datetime], first_claim: datetime) -> list[datetime]:
    """The slots of the downtime (``missed``, in order) that fire under ``policy``."""
    if policy == "fire_once":
        return missed[-1:]
    if policy == "fire_all":
        return missed[-FIRE_ALL_MAX:]
    assert policy == "skip", policy
    return [s for s in missed[-1:] if s >= first_claim - timedelta(seconds=SKIP_GRACE)]


def _missed_rows(recorded: list[datetime]) -> list[tuple[datetime, datetime | None, int]]:
    """The rows the ledger holds for the ``recorded`` slots, as (slot, missed_until, count):
    a row each up to ``RECORD_MAX``, one summary row beyond."""
    if len(recorded) > RECORD_MAX:
        return [(recorded[0], recorded[-1], len(recorded))]
    return [(slot, None, 1) for slot in recorded]


def _span(slots: list[datetime]) -> str:
    return f"[{slots[0]} .. {slots[-1]}]" if slots else "[]"


def _instant(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text else None


def _slot(row: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(row["slot"])


def test_a_beat_back_after_downtime_fires_each_task_once_then_every_slot(tmp_path: Path) -> None:
    run = E2ERun(BACKEND, tmp_path)
    try:
        down_since = real_now() - timedelta(minutes=8)
        run.seed(
            [
                {
                    "name": name,
                    "schedule_kind": "interval",
                    "interval_every": every,
                    "interval_unit": "seconds",
                    "misfire_policy": policy,
                    **extra,
                }
                for name, every, policy, extra in (
                    ("once-3s", 3, "fire_once", {}),
                    ("once-1s", 1, "fire_once", {}),
                    ("all-1s", 1, "fire_all", {}),
                    # its latest missed slot some 80 s before the beat's first claim: past
                    # the grace, so skip fires none (its next slot is 2 minutes away)
                    ("skip-200s", 200, "skip", {"misfire_grace_seconds": SKIP_GRACE}),
                )
            ],
            down_since,
        )
        run.start_recorder()
        run.start_beat(0.0)
        time.sleep(14)
        end = real_now()
        codes = run.stop()
        dump = run.tool("dump")
    finally:
        run.close()
    assert set(codes.values()) == {0}, f"exit codes {codes}\n{run.logs()}"
    # The downtime, as the ledger has it: from each task's first slot to the beat's first
    # claim (one beat: every run of its first round is claimed at the instant it began
    # claiming, so the earliest claimed_at is that instant, by the authority's clock).
    first_claim = min(datetime.fromisoformat(r["claimed_at"]) for r in dump["runs"])
    assert [_instant(n["claiming_since"]) for n in dump["nodes"]] == [first_claim], dump["nodes"]
    until = end - timedelta(seconds=1.5)  # later slots may still be on their way
    policies = {"once": "fire_once", "all": "fire_all", "skip": "skip"}
    seen_policies = set()
    for task in sorted(dump["tasks"], key=lambda t: t["name"]):
        name = task["name"]
        policy = policies[name.split("-")[0]]
        seen_policies.add(policy)
        schedule = schedule_of(task)
        first_slot = datetime.fromisoformat(task["anchor"])
        downtime = list(schedule.slots_between(first_slot, first_claim))
        # enough missed slots that the bounds bite: fire_all's, and a summary row's
        assert len(downtime) > (FIRE_ALL_MAX + RECORD_MAX if policy == "fire_all" else 0), name
        rows = [r for r in dump["runs"] if r["task_id"] == task["id"]]
        published = sorted(m.slot for m in run.received if m.periodic_task_id == task["id"])
        assert len(published) == len(set(published)), f"{name}: a slot published twice"

        fired = _catch_up(policy, downtime, first_claim)
        if policy == "skip":
            assert fired == [], f"{name}: its latest missed slot is within the grace"
        recorded = [s for s in downtime if s not in fired]
        caught_up = [s for s in published if s < first_claim]
        assert caught_up == fired, (
            f"{name} ({policy}): {len(downtime)} slots in the downtime, "
            f"{len(caught_up)} catch-up runs {_span(caught_up)}, expected {len(fired)} "
            f"{_span(fired)}"
        )
        missed_rows = sorted(
            (_slot(r), _instant(r["missed_until"]), r["missed_count"])
            for r in rows
            if r["status"] == "missed"
        )
        assert missed_rows == _missed_rows(recorded), f"{name} ({policy}): {missed_rows}"
        # Nothing else for the downtime: its runs are the catch-up and the missed rows.
        for_downtime = [r for r in rows if _slot(r) < first_claim]
        assert len(for_downtime) == len(fired) + len(missed_rows), (name, for_downtime)
        # From the first claim on every slot fires, once.
        due = list(schedule.slots_between(first_claim, until))
        assert [s for s in published if first_claim <= s <= until] == due, name
        print(
            f"{name}: {len(downtime)} slots in the downtime, {len(fired)} fired, "
            f"{len(recorded)} recorded missed in {len(missed_rows)} rows; {len(due)} after"
        )
    assert seen_policies == set(policies.values()), seen_policies
