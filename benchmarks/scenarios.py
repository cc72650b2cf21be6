"""The scenarios of the comparison. Each function runs one scheduler once and returns a
plain dict of results (JSON-ready; :mod:`benchmarks.report` turns them into tables and plots).

All times are true time (this process's clock, epoch seconds) unless named otherwise.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

from benchmarks.peers import Entry, Peer
from benchmarks.recorder import (
    Message,
    Schedule,
    Tally,
    match_in_order,
    match_nearest,
    origin_pid,
    percentile,
    percentile_bounded,
)
from benchmarks.trial import Services, Trial, pg_exec

#: Wall-clock offsets of the beats, in start order: beat k of a K-beat run has OFFSETS[k].
#: The first beat started is the fast one, so a scheduler with one active beat (RedBeat's
#: lock holder) runs on a clock 0.7 s ahead, as happens whenever that beat's host leads.
#: ``--offsets`` replaces them for a run (the skew scenario of the former bench_skew.py
#: used 0, +2.5 and -4 s).
OFFSETS: tuple[float, ...] = (0.7, -1.3, 0.0)
#: Wait after the first beat printed its start-up banner before starting the others, so that
#: the first beat is the one that takes RedBeat's lock.
BANNER_WAIT = 1.0

Log = Callable[[str], None]


def _at(seconds_from_now: float) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=seconds_from_now)


def _sleep_until(instant: float) -> None:
    time.sleep(max(0.0, instant - time.time()))


def _schedules(entries: list[Entry]) -> dict[int, Schedule]:
    return {e.index: Schedule(e.first_due.timestamp(), e.every) for e in entries}


def _timing(tally: Tally) -> dict[str, Any]:
    late = [o for o in tally.offsets if o >= 0]
    early = [-o for o in tally.offsets if o < 0]
    return {
        "due": tally.due,
        "fired": tally.fired,
        "duplicates": tally.duplicates,
        "missed": tally.missed,
        "messages": len(tally.offsets),
        "early": len(early),
        "early_p50": percentile(early, 50) if early else 0.0,
        "early_p99": percentile(early, 99) if early else 0.0,
        "early_max": max(early, default=0.0),
        "late_p50": percentile(late, 50),
        "late_p99": percentile(late, 99),
        "late_max": max(late, default=float("nan")),
        "slot_mismatches": tally.slot_mismatches,
    }


def _lead(beats: int) -> float:
    """Seconds from seeding to the first due instant: time for ``beats`` beats to start."""
    return 5.0 + 1.2 * beats


def _start_beats(trial: Trial, count: int) -> None:
    for i, offset in enumerate(OFFSETS[:count]):
        trial.start_beat(offset, wait_banner=BANNER_WAIT if i == 0 else 0.0)


def _publishers(trial: Trial, stamps: list[Any]) -> list[float]:
    """Offsets of the beats that published at least one of ``stamps`` (messages)."""
    pids = {origin_pid(m.origin) for m in stamps}
    return [b.offset for b in trial.beats if b.pid in pids]


# -- 1 and 2: duplicates, misses and dispatch timing under skew --------------------------------


def skew(services: Services, peer: Peer, beats: int, seconds: float, log: Log) -> dict[str, Any]:
    """``beats`` beats skewed by OFFSETS, 30 entries every 4-6 s, ``seconds`` of due instants."""
    trial = Trial(services, peer)
    try:
        first = _at(_lead(beats))
        entries = [Entry(i, 4 + i % 3, first + timedelta(seconds=0.13 * i)) for i in range(30)]
        trial.seed(entries)
        _start_beats(trial, beats)
        start = first.timestamp()
        end = start + seconds
        _sleep_until(end + 2.5)
        trial.stop()
        trial.check_undisturbed()
        tally = match_nearest(trial.recorder.messages, _schedules(entries), start, end)
        result = {
            "peer": peer.key,
            "beats": beats,
            "seconds": seconds,
            "offsets": [b.offset for b in trial.beats],
            "measured_offsets": [round(b.measured_offset, 3) for b in trial.beats],
            "publishing_beats": _publishers(trial, trial.recorder.messages),
            **_timing(tally),
            "sample": [round(o, 4) for o in tally.offsets],
        }
        log(
            f"  {peer.label:<20} K={beats}: due {tally.due}, dup {tally.duplicates}, "
            f"missed {tally.missed}, early {result['early']} (max {result['early_max']:.3f} s), "
            f"late p99 {result['late_p99']:.3f} s"
        )
        return result
    finally:
        trial.close()


# -- 3: failover ----------------------------------------------------------------------------


def failover(
    services: Services, peer: Peer, tuned: bool, before: float, after: float, log: Log
) -> dict[str, Any]:
    """Three skewed beats, 40 entries every 4 s (one due instant every 0.1 s); after
    ``before`` seconds SIGKILL the beat that published last, watch ``after`` seconds more."""
    trial = Trial(services, peer, tuned=tuned)
    try:
        first = _at(_lead(3))
        entries = [Entry(i, 4, first + timedelta(seconds=0.1 * i)) for i in range(40)]
        trial.seed(entries)
        _start_beats(trial, 3)
        start = first.timestamp()
        _sleep_until(start + before)
        recent = max(trial.recorder.messages, key=lambda m: m.stamp, default=None)
        victim = trial.beat_by_pid(origin_pid(recent.origin) if recent else None) or trial.beats[0]
        lock_ttl = trial.lock_ttl()
        killed = trial.kill(victim)
        _sleep_until(killed + after)
        trial.stop()
        trial.check_undisturbed()
        messages = trial.recorder.messages
        bound = killed + after
        schedules = _schedules(entries)
        before_kill = match_nearest(messages, schedules, start, killed)
        after_kill = match_nearest(
            [m for m in messages if m.stamp <= bound], schedules, killed, bound - 3.0
        )
        next_stamps = sorted(m.stamp for m in messages if killed < m.stamp <= bound)
        normal = sorted(m.stamp for m in messages if start <= m.stamp < killed)
        spacing = [b - a for a, b in itertools.pairwise(normal)]
        result = {
            "peer": peer.key,
            "tuned": tuned,
            "before": before,
            "after": after,
            "victim_offset": victim.offset,
            "lock_ttl_at_kill": lock_ttl,
            "gap": (next_stamps[0] - killed) if next_stamps else None,
            "normal_spacing_p99": percentile(spacing, 99),
            "due_after": after_kill.due,
            "lost": after_kill.missed,
            # the worst-served slot after the kill: its first message - its due instant
            "late_after_max": max(after_kill.first_offsets, default=float("nan")),
            "duplicates_before": before_kill.duplicates,
            "duplicates_after": after_kill.duplicates,
            "due_before": before_kill.due,
            "missed_before": before_kill.missed,
            "timeline": [round(m.stamp - killed, 3) for m in messages if start <= m.stamp <= bound],
        }
        gap = f"{result['gap']:.2f} s" if result["gap"] is not None else f"> {after:.0f} s"
        log(
            f"  {peer.label:<20} {'tuned' if tuned else 'shipped':<7}: gap {gap}, lost "
            f"{after_kill.missed}/{after_kill.due} in {after:.0f} s, duplicates before/after "
            f"{before_kill.duplicates}/{after_kill.duplicates}"
        )
        return result
    finally:
        trial.close()


# -- 4: scale ---------------------------------------------------------------------------------


def scale(
    services: Services,
    peer: Peer,
    tasks: int,
    seconds: float,
    settle: float,
    log: Log,
    beats: int = 1,
    sql_seed: bool = False,
) -> dict[str, Any]:
    """One beat (``beats`` unskewed ones), ``tasks`` entries every 60 s whose first due
    instants are spread evenly over the minute after launch (tasks/60 slots due per second
    from the start); a bounded window of ``seconds``. Lateness and the sustained rate are
    taken after ``settle`` seconds. CPU is summed over the beats, RSS is the largest.
    ``sql_seed`` (celery_driftsafe only): the same rows written by one ``INSERT … SELECT``
    (:meth:`Trial.sql_seed`) instead of the ORM."""
    trial = Trial(services, peer)
    try:
        # seeding time, measured: 0.2-0.4 ms an entry by the ORM (celery_driftsafe's 100,000
        # took 27.9 s on one day and 40.4 s on another), ~0.04 ms by SQL; a seeding that runs
        # past the launch is reported (seed_overran)
        pad = 5.0 + tasks * (0.08e-3 if sql_seed else 0.6e-3)
        launch_at = _at(pad)
        entries = [
            Entry(i, 60, launch_at + timedelta(seconds=60.0 * i / tasks)) for i in range(tasks)
        ]
        seeded_in = trial.sql_seed(tasks, 60, launch_at, 60.0) if sql_seed else trial.seed(entries)
        launch = launch_at.timestamp()
        overran = max(0.0, time.time() - launch)
        _sleep_until(launch)
        c0 = trial.counters()
        servers0 = trial.server_cpu()
        for _ in range(beats):
            trial.start_beat(0.0)
        end = launch + seconds
        _sleep_until(end)
        c1 = trial.counters()
        servers1 = trial.server_cpu()
        cpu = sum(b.cpu for b in trial.beats)
        alive = all(b.process.poll() is None for b in trial.beats)
        trial.stop()
        trial.check_undisturbed()
        messages = [m for m in trial.recorder.messages if m.stamp <= end]
        schedules = _schedules(entries)
        whole = match_in_order(messages, schedules, launch, end - 2.0)
        steady = match_in_order(messages, schedules, launch + settle, end - 2.0)
        elapsed = c1.at - c0.at
        first = min((m.stamp for m in messages), default=None)
        stamps = sorted(m.stamp for m in messages)
        # the longest stretch without a single send, once sending started
        pause = max((b - a for a, b in itertools.pairwise([*stamps, end])), default=None)
        sustained = sum(1 for m in messages if m.stamp >= launch + settle) / (seconds - settle)
        # a slot still unsent at the end is at least (end - due) late
        unsent = [end - t for t in steady.missed_at]
        p50, p50_bound = percentile_bounded(steady.offsets, unsent, 50)
        p99, p99_bound = percentile_bounded(steady.offsets, unsent, 99)
        worst, worst_bound = percentile_bounded(steady.offsets, unsent, 100)
        result = {
            "peer": peer.key,
            "tasks": tasks,
            "beats": beats,
            "seconds": seconds,
            "settle": settle,
            "seeded_in": seeded_in,
            "seeded_by": "sql" if sql_seed else "orm",
            "seed_overran": overran,
            "alive_at_end": alive,
            "due_rate": tasks / 60.0,
            "due": whole.due,
            "sent": whole.fired,
            "sent_fraction": whole.fired / whole.due if whole.due else float("nan"),
            "startup": (first - launch) if first is not None else None,
            "longest_pause": pause,
            "sustained": sustained,
            "late_p50": p50,
            "late_p50_at_least": p50_bound,
            "late_p99": p99,
            "late_p99_at_least": p99_bound,
            "late_max": worst,
            "late_max_at_least": worst_bound,
            "steady_due": steady.due,
            "steady_sent": steady.fired,
            "cpu_percent": 100.0 * cpu / seconds,
            "rss_mb": max(b.peak_rss_kb for b in trial.beats) / 1024,
            "cpu_s": cpu,
            "pg_cpu_s": servers1["pg"] - servers0["pg"],
            "redis_cpu_s": servers1["redis"] - servers0["redis"] if services.own_redis else None,
            "db_xacts_per_s": (c1.xacts - c0.xacts) / elapsed,
            "db_rows_read_per_s": (c1.rows_read - c0.rows_read) / elapsed,
            "db_rows_written_per_s": (c1.rows_written - c0.rows_written) / elapsed,
            "store_commands_per_s": (c1.store_commands - c0.store_commands) / elapsed,
            "slot_mismatches": whole.slot_mismatches,
        }
        if overran:
            log(f"  seeding ran {overran:.1f} s past the launch instant")
        log(
            f"  {peer.label:<20} {tasks:>7}: sent {whole.fired}/{whole.due} "
            f"({100 * result['sent_fraction']:.1f}%), start-up "
            f"{result['startup'] if first is None else round(result['startup'], 2)} s, "
            f"{sustained:.0f}/s, p99 {result['late_p99']:.3f} s, CPU "
            f"{result['cpu_percent']:.0f}%, RSS {result['rss_mb']:.0f} MB"
        )
        redis_cpu = result["redis_cpu_s"]
        log(
            f"    seeded by {result['seeded_by']} in {seeded_in:.1f} s; CPU s in the window: "
            f"beats {cpu:.1f}, PostgreSQL backends (exited ones of every database included) "
            f"{result['pg_cpu_s']:.1f}, Redis "
            f"{'(shared, not sampled)' if redis_cpu is None else f'{redis_cpu:.1f}'}"
        )
        return result
    finally:
        trial.close()


# -- 5: schedule edits ------------------------------------------------------------------------


def edits(services: Services, peer: Peer, count: int, spacing: float, log: Log) -> dict[str, Any]:
    """Three skewed beats; 20 background entries every 60 s; ``count`` idle entries (every
    3600 s) are edited one after another to run every 1 s, ``spacing`` seconds apart."""
    trial = Trial(services, peer)
    try:
        seeded = datetime.now(UTC)
        first = _at(_lead(3))
        background = [Entry(i, 60, first + timedelta(seconds=3.0 * i)) for i in range(20)]
        targets = [Entry(100 + j, 3600, seeded + timedelta(seconds=3600)) for j in range(count)]
        trial.seed(background + targets)
        _start_beats(trial, 3)
        start = first.timestamp() + 2.0
        plan = [
            {
                "index": t.index,
                "every": 1,
                "at": datetime.fromtimestamp(start + spacing * j, UTC).isoformat(),
            }
            for j, t in enumerate(targets)
        ]
        done = trial.set_intervals(plan)
        _sleep_until(time.time() + 6.0)
        trial.stop()
        trial.check_undisturbed()
        firsts, all_beats, raw, beats_firing = [], [], [], []
        for edit in done:
            edited = datetime.fromisoformat(edit["edited_at"]).timestamp()
            due = max(
                edited,
                datetime.fromisoformat(edit["due_at"]).timestamp() if edit["due_at"] else edited,
            )
            after = sorted(
                (
                    m
                    for m in trial.recorder.messages
                    if m.index == edit["index"] and m.stamp >= edited - 0.5
                ),
                key=lambda m: m.stamp,
            )
            if not after:
                firsts.append(None)
                continue
            raw.append(after[0].stamp - edited)
            firsts.append(after[0].stamp - due)
            per_beat: dict[str, float] = {}
            for m in after:
                per_beat.setdefault(m.origin, m.stamp)
            beats_firing.append(len(per_beat))
            all_beats.append(max(per_beat.values()) - due)
        ok = [f for f in firsts if f is not None]
        result = {
            "peer": peer.key,
            "count": count,
            "edit_to_first_p50": percentile(raw, 50) if raw else None,
            "edit_to_first_max": max(raw, default=None),
            "first_late_p50": percentile(ok, 50) if ok else None,
            "first_late_max": max(ok, default=None),
            "all_beats_max": max(all_beats, default=None),
            "beats_firing": max(beats_firing, default=0),
            "never_fired": sum(1 for f in firsts if f is None),
            "delays": [round(f, 3) if f is not None else None for f in firsts],
        }
        log(
            f"  {peer.label:<20}: edit -> first firing p50 {result['edit_to_first_p50']}, "
            f"late vs due max {result['first_late_max']}, all beats {result['all_beats_max']}"
        )
        return result
    finally:
        trial.close()


# -- 6: a burst: every entry due at one instant --------------------------------------------


def _ledger(trial: Trial, before: float) -> dict[str, int]:
    """celery_driftsafe only: ledger rows for slots before ``before`` and missed slots."""
    rows = pg_exec(
        "SELECT count(*), count(*) FILTER (WHERE status = 'missed'), "
        "coalesce(sum(missed_count) FILTER (WHERE status = 'missed'), 0) "
        f"FROM celery_driftsafe_run WHERE slot < to_timestamp({before})",
        trial.db,
    )[0]
    return {"rows": int(rows[0]), "missed_rows": int(rows[1]), "missed_slots": int(rows[2])}


def _every_entry_sent(trial: Trial, tasks: int) -> bool:
    """Whether each of ``tasks`` entries has sent a message. Messages are parsed only once
    as many have arrived as there are entries: parsing them while they come (every 0.25 s,
    the whole list each time) took the recorder ~0.2 of a core during a wave, from the two
    cores the beats and the database share. Arrival stamps are taken as messages are popped
    either way."""
    if trial.recorder.received < tasks:
        return False
    return len({m.index for m in trial.recorder.messages}) >= tasks


def _sample_until(trial: Trial, done: Callable[[], bool], until: float) -> None:
    while time.time() < until and not done():
        time.sleep(0.25)


def burst(
    services: Services,
    peer: Peer,
    tasks: int,
    beats: int,
    bound: float,
    log: Log,
    *,
    sql_seed: bool = False,
    idle: float | None = None,
) -> dict[str, Any]:
    """``tasks`` entries every 60 s, all first due at one instant T; ``beats`` unskewed beats
    started and given time to come up before T. Every message is recorded until the wave is
    out or ``bound`` seconds after T; a bound past 60 s meets the next slot, whose messages are
    counted apart (``next_slot_messages``). ``sql_seed``
    (celery_driftsafe only): the rows written by one statement (:meth:`Trial.sql_seed`);
    ``idle``: seconds the beats are up before T (default ~0.5 ms an entry)."""
    trial = Trial(services, peer)
    try:
        # seeding (~0.3 ms an entry by the ORM), start-up of the beats (a scheduler may load
        # every entry at start: ~0.5 ms an entry), so that the beats are up and idle when the
        # wave is due
        seeding = tasks * (0.05e-3 if sql_seed else 0.3e-3)
        due_at = _at(8.0 + seeding + _lead(beats) + (tasks * 0.5e-3 if idle is None else idle))
        if sql_seed:
            trial.sql_seed(tasks, int(PERIOD), due_at, 0.0)
        else:
            trial.seed([Entry(i, int(PERIOD), due_at) for i in range(tasks)])
        due = due_at.timestamp()
        overran = max(0.0, time.time() - due)
        for _ in range(beats):
            trial.start_beat(0.0)
        _sleep_until(due - 1.0)
        trial.mark()
        c0 = trial.counters()
        servers0 = trial.server_cpu()
        end = due + bound
        _sample_until(trial, partial(_every_entry_sent, trial, tasks), end)
        drained_at = time.time()
        c1 = trial.counters()
        servers1 = trial.server_cpu()
        alive = all(b.process.poll() is None for b in trial.beats)
        cpu = sum(b.cpu - b.cpu_mark for b in trial.beats)
        rss = max(b.peak_rss_kb for b in trial.beats) / 1024
        _sleep_until(min(end, drained_at + 2.0))  # late duplicates would come now
        trial.stop()
        trial.check_undisturbed()
        # the wave's messages: a wave longer than the tasks' period meets their next slot, whose
        # messages are not the wave's duplicates (ours say their slot; the others' are cut at
        # the next slot's instant)
        recorded = [m for m in trial.recorder.messages if m.stamp <= end]
        messages = [m for m in recorded if _of_the_wave(m, due)]
        per_entry: dict[int, list[float]] = {}
        for m in messages:
            per_entry.setdefault(m.index, []).append(m.stamp - due)
        firsts = [min(v) for v in per_entry.values()]
        late = [o for o in firsts if o >= 0]
        unsent = [end - due] * (tasks - len(per_entry))
        p50, p50_bound = percentile_bounded(late, unsent, 50)
        p99, p99_bound = percentile_bounded(late, unsent, 99)
        worst, worst_bound = percentile_bounded(late, unsent, 100)
        ledger = _ledger(trial, due + 1.0) if peer.key == "driftsafe" else None
        result = {
            "peer": peer.key,
            "tasks": tasks,
            "beats": beats,
            "bound": bound,
            "seed_overran": overran,
            "alive_at_end": alive,
            "sent": len(per_entry),
            "messages": len(messages),
            "duplicates": sum(len(v) - 1 for v in per_entry.values()),
            "early": sum(1 for m in messages if m.stamp < due),
            "unsent": tasks - len(per_entry),
            "recorded_missed": ledger["missed_slots"] if ledger else None,
            "late_p50": p50,
            "late_p50_at_least": p50_bound,
            "late_p99": p99,
            "late_p99_at_least": p99_bound,
            "late_max": worst,
            "late_max_at_least": worst_bound,
            "drain": worst if not worst_bound else None,
            "rate": len(per_entry) / worst if worst and not worst_bound else None,
            "cpu_s": cpu,
            "cpu_us_per_slot": 1e6 * cpu / len(per_entry) if per_entry else None,
            "pg_cpu_s": servers1["pg"] - servers0["pg"],
            "rss_mb": rss,
            "db_xacts_per_s": (c1.xacts - c0.xacts) / (c1.at - c0.at),
            "next_slot_messages": len(recorded) - len(messages),
            "slot_mismatches": sum(
                1
                for m in recorded
                if m.slot is not None and min(abs(m.slot - due), abs(m.slot - due - PERIOD)) > 1e-3
            ),
            # arrival curve for the plot: (seconds after T, messages so far), 200 points
            "curve": _curve(sorted(firsts)),
        }
        drain = f"{worst:.1f} s" if result["drain"] is not None else f"> {bound:.0f} s"
        log(
            f"  {peer.label:<20} {tasks:,} x K={beats}: sent {len(per_entry):,}, wave out "
            f"after {drain}, p50 {p50:.2f} s, p99 {p99:.2f} s, dup {result['duplicates']}, "
            f"early {result['early']}, recorded missed {result['recorded_missed']}, "
            f"CPU {cpu:.1f} s"
        )
        return result
    finally:
        trial.close()


#: The burst's tasks run every minute.
PERIOD = 60.0


def _of_the_wave(message: Message, due: float) -> bool:
    """Whether a recorded message is one of the burst's wave (due at ``due``), not of its
    tasks' next slot, which a wave longer than their period meets: ours say their slot, the
    others' are cut at the next slot's instant."""
    if message.slot is None:
        return message.stamp < due + PERIOD
    return abs(message.slot - due) <= 1e-3


def _curve(offsets: list[float], points: int = 200) -> list[list[float]]:
    if not offsets:
        return []
    step = max(1, len(offsets) // points)
    picked = [[round(offsets[i], 3), i + 1] for i in range(0, len(offsets), step)]
    if picked[-1][1] != len(offsets):
        picked.append([round(offsets[-1], 3), len(offsets)])
    return picked


# -- 7: recovery: back after an outage with no beat running --------------------------------


def recovery(
    services: Services,
    peer: Peer,
    tasks: int,
    outage: float,
    bound: float,
    log: Log,
    *,
    sql_seed: bool = False,
) -> dict[str, Any]:
    """``tasks`` entries every 60 s, first due ``outage`` seconds ago (spread over that
    minute) and never run since: one beat starts. How long until the first message and until
    every entry has sent its catch-up, what the ledger wrote for the outage (ours), memory.
    ``sql_seed`` (celery_driftsafe only): the rows written by one statement."""
    trial = Trial(services, peer)
    try:
        began = time.time()
        first = datetime.fromtimestamp(began - outage, UTC)
        if sql_seed:
            trial.sql_seed(tasks, 60, first, 60.0)
        else:
            trial.seed(
                [Entry(i, 60, first + timedelta(seconds=60.0 * i / tasks)) for i in range(tasks)]
            )
        launch = time.time()
        servers0 = trial.server_cpu()
        beat = trial.start_beat(0.0)
        end = launch + bound
        _sample_until(trial, partial(_every_entry_sent, trial, tasks), end)
        caught_up = time.time()
        servers1 = trial.server_cpu()
        cpu, rss = beat.cpu, beat.peak_rss_kb / 1024
        alive = beat.process.poll() is None
        trial.stop()
        trial.check_undisturbed()
        messages = [m for m in trial.recorder.messages if m.stamp <= end]
        firsts: dict[int, float] = {}
        for m in messages:
            firsts.setdefault(m.index, m.stamp)
        everyone = max(firsts.values()) - launch if len(firsts) == tasks else None
        ledger = _ledger(trial, launch) if peer.key == "driftsafe" else None
        result = {
            "peer": peer.key,
            "tasks": tasks,
            "outage_h": outage / 3600,
            "bound": bound,
            "alive_at_end": alive,
            "first_message": min(firsts.values()) - launch if firsts else None,
            "all_caught_up": everyone,
            "caught_up": len(firsts),
            "catch_up_messages": len(messages),
            "ledger_rows_per_task": ledger["rows"] / tasks if ledger else None,
            "missed_slots": ledger["missed_slots"] if ledger else None,
            "cpu_s": cpu,
            "pg_cpu_s": servers1["pg"] - servers0["pg"],
            "rss_mb": rss,
            "watched": caught_up - launch,
        }
        log(
            f"  {peer.label:<20} {tasks:,} back after {outage / 3600:g} h: first message "
            f"{result['first_message']}, all caught up {everyone}, rows/task "
            f"{result['ledger_rows_per_task']}, RSS {rss:.0f} MB"
        )
        return result
    finally:
        trial.close()
