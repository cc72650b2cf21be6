"""Record every published message with the true time it arrived, and match messages to the
instants at which they were due.

The recorder (:class:`celery_driftsafe.testing.recording.QueueRecorder`, shared with the
end-to-end tests) pops the trial's broker list as messages arrive and stamps them with this
process's wall clock: it is not skewed, so it is the clock of the PostgreSQL and Redis servers
on this machine ("true time"); a stamp is late by at most one drain (milliseconds).

The peers put no slot in their messages, so a message is matched to a due instant by task
entry and time, the same way for every scheduler (ours included; its own slot header is only
a cross-check):

* :func:`match_nearest`: each message counts for its entry's nearest due instant. Used where
  beats are skewed by at most ~1.3 s and entries run every 2-6 s, so the nearest instant is
  unambiguous; duplicates = messages beyond the first for an instant; early = stamped before it.
* :func:`match_in_order`: the j-th message of an entry counts for its j-th due instant. Used at
  scale with one beat, where a slow scheduler can be minutes late and "nearest" would be wrong.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from celery_driftsafe.testing.recording import QueueRecorder, nearest_rank, percentile

__all__ = [
    "Message",
    "Recorder",
    "Schedule",
    "Tally",
    "match_in_order",
    "match_nearest",
    "origin_pid",
    "percentile",
    "percentile_bounded",
]

#: Only messages of this task are counted (a scheduler may add housekeeping entries).
TASK = "bench.tick"


@dataclass(frozen=True, slots=True)
class Message:
    stamp: float  # true arrival time, epoch seconds
    index: int  # entry index (args[0])
    origin: str  # Celery's "gen<pid>@host" of the publishing process
    slot: float | None  # celery_driftsafe's slot header, epoch seconds (ours only)


def _parse(raw: bytes, stamp: float) -> Message | None:
    headers = json.loads(raw)["headers"]
    if headers.get("task") != TASK:
        return None
    args = headers.get("argsrepr", "").strip("[]() ").split(",")
    slot = headers.get("driftsafe_slot")
    return Message(
        stamp=stamp,
        index=int(args[0]),
        origin=str(headers.get("origin", "")),
        slot=datetime.fromisoformat(slot).timestamp() if slot else None,
    )


def origin_pid(origin: str) -> int | None:
    """The pid in Celery's ``gen<pid>@host`` origin header."""
    head = origin.split("@", 1)[0]
    return int(head[3:]) if head.startswith("gen") and head[3:].isdigit() else None


class Recorder(QueueRecorder[Message]):
    """Records the trial's broker list, keeping every ``bench.tick`` message as a
    :class:`Message`."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(url, queue, _parse)


@dataclass(frozen=True)
class Schedule:
    """An entry's due instants: ``first_due + k * every`` for ``k >= 0`` (epoch seconds)."""

    first_due: float
    every: float

    def instants(self, start: float, end: float) -> list[float]:
        k = max(0, math.ceil((start - self.first_due) / self.every))
        out = []
        while (t := self.first_due + k * self.every) < end:
            out.append(t)
            k += 1
        return out

    def nearest(self, stamp: float) -> float:
        k = max(0, round((stamp - self.first_due) / self.every))
        return self.first_due + k * self.every


@dataclass
class Tally:
    """What arrived against what was due, over due instants in one window."""

    due: int = 0
    fired: int = 0  # instants with at least one message
    duplicates: int = 0  # messages beyond the first per instant
    offsets: list[float] = field(default_factory=list)  # every message: stamp - instant
    first_offsets: list[float] = field(default_factory=list)  # first message per instant
    missed_at: list[float] = field(default_factory=list)  # instants without a message
    slot_mismatches: int = 0  # ours only: nearest instant != the slot in the header

    @property
    def missed(self) -> int:
        return len(self.missed_at)

    @property
    def early(self) -> list[float]:
        return [o for o in self.offsets if o < 0]


def match_nearest(
    messages: Iterable[Message], schedules: dict[int, Schedule], start: float, end: float
) -> Tally:
    """Count each message for its entry's nearest due instant; tally instants in
    ``[start, end)`` (messages for instants outside the window are ignored)."""
    per_instant: dict[tuple[int, float], list[float]] = defaultdict(list)
    mismatches = 0
    for m in messages:
        schedule = schedules.get(m.index)
        if schedule is None:
            continue
        instant = schedule.nearest(m.stamp)
        if start <= instant < end:
            per_instant[(m.index, instant)].append(m.stamp - instant)
            if m.slot is not None and abs(m.slot - instant) > 1e-3:
                mismatches += 1
    tally = Tally(slot_mismatches=mismatches)
    for index, schedule in schedules.items():
        for instant in schedule.instants(start, end):
            tally.due += 1
            offsets = sorted(per_instant.get((index, instant), []))
            if not offsets:
                tally.missed_at.append(instant)
                continue
            tally.fired += 1
            tally.duplicates += len(offsets) - 1
            tally.offsets.extend(offsets)
            tally.first_offsets.append(offsets[0])
    return tally


def match_in_order(
    messages: Iterable[Message], schedules: dict[int, Schedule], start: float, end: float
) -> Tally:
    """The j-th message of an entry counts for its j-th due instant at or after its first
    due instant; tally instants in ``[start, end)``."""
    stamps: dict[int, list[float]] = defaultdict(list)
    slots: dict[int, list[float | None]] = defaultdict(list)
    for m in sorted(messages, key=lambda m: m.stamp):
        stamps[m.index].append(m.stamp)
        slots[m.index].append(m.slot)
    tally = Tally()
    for index, schedule in schedules.items():
        arrived = stamps.get(index, [])
        for j, instant in enumerate(schedule.instants(schedule.first_due, end)):
            if (
                j < len(arrived)
                and slots[index][j] is not None
                and abs(slots[index][j] - instant) > 1e-3
            ):  # type: ignore[operator]
                tally.slot_mismatches += 1
            if instant < start:
                continue
            tally.due += 1
            if j < len(arrived):
                tally.fired += 1
                tally.offsets.append(arrived[j] - instant)
                tally.first_offsets.append(arrived[j] - instant)
            else:
                tally.missed_at.append(instant)
    return tally


def percentile_bounded(
    exact: Sequence[float], at_least: Sequence[float], q: float
) -> tuple[float, bool]:
    """Percentile of values of which some are only known from below (a slot not sent by the
    end of a window is at least ``end - due`` late). Returns (value, is_lower_bound)."""
    pairs = sorted([(v, False) for v in exact] + [(v, True) for v in at_least])
    if not pairs:
        return float("nan"), False
    rank = nearest_rank(len(pairs), q)  # the rank of percentile(), so both agree
    value = pairs[rank - 1][0]
    return value, any(bound for v, bound in pairs[:rank])
