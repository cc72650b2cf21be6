"""Side-by-side benchmark: celery_driftsafe against django-celery-beat and RedBeat.

Runs each scenario for each scheduler in turn, on this machine, in one run, with the same
schedules; prints the tables and writes docs/comparison.md with PNG plots under
docs/_static/comparison/ (and the raw results as results.json beside them).

    python -m benchmarks compare                  # the published scenarios (~40 min)
    python -m benchmarks compare --quick          # every scenario, small sizes (~6 min)
    python -m benchmarks compare --scenarios scale --tasks 10000 --no-docs
    python -m benchmarks compare --scenarios burst --burst-tasks 20000 --merge RESULTS_JSON
    python -m benchmarks compare --render-only    # the page again from its results.json

(``bash benchmarks/compare.sh ...`` first builds ``.venv-bench`` with the peers, then runs
exactly this.)

Scenarios: skew (duplicates, misses and timing with K = 1, 2, 3 skewed beats), failover
(SIGKILL the publishing beat; peers as shipped and tuned), scale (1k/10k/100k entries spread
over the minute on PostgreSQL: the steady load), edits (schedule edit propagation to running
beats), burst (every entry due at one instant: ours with K = 1 and 3 beats, each peer with
one), recovery (back after an outage with no beat; not in the default set).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks import report, scenarios
from benchmarks.peers import PEERS
from benchmarks.trial import ROOT, Disturbed, Services, pg_exec

SCENARIOS = ("skew", "failover", "scale", "edits", "burst", "recovery")
#: What runs without --scenarios (recovery is long and only ours writes a ledger: ask for it).
DEFAULT_SCENARIOS = ("skew", "failover", "scale", "edits", "burst")
DISTS = (
    "celery-driftsafe",
    "celery",
    "kombu",
    "Django",
    "django-celery-beat",
    "celery-redbeat",
    "redis",
    "psycopg",
)
SCALE_WINDOWS = {1_000: 60.0, 10_000: 90.0, 100_000: 150.0}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="every scenario at small sizes and short windows (smoke run)",
    )
    parser.add_argument(
        "--scenarios", nargs="+", choices=SCENARIOS, default=list(DEFAULT_SCENARIOS)
    )
    parser.add_argument("--peers", nargs="+", choices=list(PEERS), default=list(PEERS))
    parser.add_argument(
        "--beats",
        type=int,
        nargs="+",
        default=None,
        help="K values of the skew scenario (default 1 2 3)",
    )
    parser.add_argument(
        "--skew-seconds",
        type=float,
        default=None,
        help="seconds of due slots per skew run (default 45)",
    )
    parser.add_argument(
        "--tasks",
        type=int,
        nargs="+",
        default=None,
        help="entry counts of the scale scenario (default 1000 10000 100000)",
    )
    parser.add_argument(
        "--scale-seconds",
        type=float,
        default=None,
        help="window of every scale run (default 60/90/150 s by size)",
    )
    parser.add_argument(
        "--scale-settle",
        type=float,
        default=None,
        help="lateness and the sustained rate of the scale runs are taken after this many "
        "seconds of the window (default 10; e.g. 70 with a 130 s window: the second minute, "
        "when every task's message has been built once)",
    )
    parser.add_argument(
        "--offsets",
        type=float,
        nargs="+",
        default=None,
        help="clock offsets (s) of the beats in start order (default "
        f"{' '.join(f'{o:+g}' for o in scenarios.OFFSETS)})",
    )
    parser.add_argument(
        "--scale-beats",
        type=int,
        default=1,
        help="beats of celery_driftsafe's scale runs (the peers run one)",
    )
    parser.add_argument(
        "--sql-seed",
        action="store_true",
        help="scale: seed celery_driftsafe's rows with one INSERT … SELECT generate_series in "
        "PostgreSQL instead of the ORM (1M tasks in well under a minute); the peers' seeding "
        "is unchanged",
    )
    parser.add_argument(
        "--burst-tasks",
        type=int,
        nargs="+",
        default=None,
        help="entries due at one instant (default 100000; --quick 2000)",
    )
    parser.add_argument(
        "--burst-beats",
        type=int,
        nargs="+",
        default=None,
        help="K values of celery_driftsafe in the burst (default 1 3; the "
        "peers run one beat: django-celery-beat's beats do not coordinate, "
        "RedBeat has one active beat)",
    )
    parser.add_argument(
        "--burst-bound",
        type=float,
        default=55.0,
        help="seconds after the instant the wave is watched (below 60)",
    )
    parser.add_argument(
        "--recovery-tasks",
        type=int,
        nargs="+",
        default=None,
        help="entries of the recovery scenario (default 10000; --quick 1000)",
    )
    parser.add_argument(
        "--outage-hours",
        type=float,
        default=None,
        help="hours without a beat before the recovery (default 24; --quick 1)",
    )
    parser.add_argument(
        "--recovery-bound",
        type=float,
        default=None,
        help="seconds watched after the beat starts (default 180; --quick 40)",
    )
    parser.add_argument(
        "--failover-after",
        type=float,
        default=None,
        help="seconds watched after the kill: the bound (default 45)",
    )
    parser.add_argument("--edits", type=int, default=None, help="edits per run (default 6)")
    parser.add_argument("--no-tuned", action="store_true", help="skip the tuned failover runs")
    parser.add_argument(
        "--docs",
        type=Path,
        default=None,
        help="where comparison.md and _static/comparison/ go (default docs/; "
        "with --quick a temporary folder, so the published page is kept)",
    )
    parser.add_argument("--no-docs", action="store_true", help="print the tables only")
    parser.add_argument(
        "--report-only",
        type=Path,
        metavar="RESULTS_JSON",
        help="rebuild tables and docs from a saved results.json, run nothing",
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite comparison.md from the results.json under --docs (default docs/), with "
        "the plots as they are: no run, no tables, no plotting",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        metavar="RESULTS_JSON",
        help="re-run only --scenarios (every peer) and replace those in a saved "
        "results.json, e.g. scale when the machine is quieter",
    )
    return parser


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    tasks = args.tasks or ([2_000] if quick else [1_000, 10_000, 100_000])
    windows = {
        t: args.scale_seconds or (12.0 if quick else SCALE_WINDOWS.get(t, 120.0)) for t in tasks
    }
    settle = args.scale_settle or (4.0 if quick else 10.0)
    if settle >= min(windows.values()):
        raise SystemExit(
            f"--scale-settle {settle:g} must be shorter than every scale window "
            f"({min(windows.values()):g} s): set --scale-seconds longer"
        )
    return {
        "beats": args.beats or ([1, 3] if quick else [1, 2, 3]),
        "skew_seconds": args.skew_seconds or (6.0 if quick else 45.0),
        "tasks": tasks,
        "windows": windows,
        "settle": settle,
        "failover_before": 4.0 if quick else 15.0,
        "failover_after": args.failover_after or (6.0 if quick else 45.0),
        "tuned": not (args.no_tuned or quick),
        "edits": args.edits or (2 if quick else 6),
        "edit_spacing": 2.5 if quick else 5.0,
        "scale_beats": args.scale_beats,
        "sql_seed": args.sql_seed,
        "burst_tasks": args.burst_tasks or ([2_000] if quick else [100_000]),
        "burst_beats": args.burst_beats or [1, 3],
        "burst_bound": args.burst_bound,
        "recovery_tasks": args.recovery_tasks or ([1_000] if quick else [10_000]),
        "outage_hours": args.outage_hours or (1.0 if quick else 24.0),
        "recovery_bound": args.recovery_bound or (40.0 if quick else 180.0),
    }


def _machine(redis_url: str) -> dict[str, str]:
    cpu = "unknown"
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as info:
        kb = int(next(line for line in info if line.startswith("MemTotal")).split()[1])
    pretty = platform.system()
    if Path("/etc/os-release").exists():
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                pretty = line.split("=", 1)[1].strip('"')
    import redis

    client = redis.Redis.from_url(redis_url)
    redis_version = client.info("server")["redis_version"]
    client.close()
    postgres = pg_exec("SELECT version()")[0][0].split(" on ")[0]
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "memory": f"{kb / 1024 / 1024:.0f} GiB",
        "os": f"{pretty}, Linux {platform.release()}",
        "python": platform.python_version(),
        "postgres": postgres,
        "redis": str(redis_version),
    }


def _versions() -> dict[str, str]:
    out = {}
    for dist in DISTS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _limits(results: dict[str, Any], own_redis: bool) -> list[str]:
    limits = [
        "Statements per second: pg_stat_statements is not loaded on this PostgreSQL server "
        "(it needs a server restart, and the server is shared), so database load is given "
        "as transactions, rows read and rows written per second from pg_stat_database. With "
        "Django's autocommit each django-celery-beat query is its own transaction; a "
        "celery_driftsafe claim is several statements in one transaction.",
    ]
    if not own_redis:
        limits.append(
            "redis-server was not found, so broker and store shared one Redis "
            "database and the store command counts include the broker's traffic."
        )
    for r in results.get("failover", []):
        if r["gap"] is None:
            ttl = r.get("lock_ttl_at_kill")
            extra = (
                f" RedBeat's lock had {ttl:.0f} s to live at the kill; a standby tries "
                "to take it once per beat_max_loop_interval (300 s as shipped), so the "
                f"expected gap is {ttl:.0f}-{ttl + 300:.0f} s."
                if ttl
                else ""
            )
            limits.append(
                f"Failover of {report.LABELS[r['peer']]} "
                f"({'tuned' if r['tuned'] else 'as shipped'}): no firing within the "
                f"{r['after']:.0f} s bound, so the gap is only known to exceed it.{extra}"
            )
    for r in results.get("scale", []):
        if not report._finished(r):
            limits.append(
                f"Scale, {report.LABELS[r['peer']]} at {r['tasks']:,} entries: did not finish, "
                f"{100 * r['sent_fraction']:.1f}% of the slots due in the window were sent "
                f"within the {r['seconds']:.0f} s bound"
                + ("" if r["alive_at_end"] else " (the beat process had exited)")
                + "."
            )
        if r.get("seed_overran"):
            limits.append(
                f"Scale, {report.LABELS[r['peer']]} at {r['tasks']:,} entries: seeding "
                f"({r['seeded_in']:.1f} s) ran {r['seed_overran']:.1f} s past the launch "
                "instant, so the beat started after its first slots were due: its start-up "
                "and lateness include that wait."
            )
    for r in results.get("errors", []):
        limits.append(
            f"{r['scenario']} / {report.LABELS.get(r['peer'], r['peer'])}: the run "
            f"failed ({r['error']})."
        )
    return limits


def _uptime() -> str:
    """``uptime``'s load averages when the run ended: the machine is shared."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    plan = _plan(args)
    if args.offsets:
        scenarios.OFFSETS = tuple(args.offsets)
    peers = [PEERS[key] for key in args.peers]
    started = datetime.now(UTC)
    began = time.time()
    results: dict[str, Any] = {s: [] for s in SCENARIOS}
    results["errors"] = []
    load: dict[str, list[float]] = {}

    def log(line: str) -> None:
        print(line, flush=True)

    def attempt(scenario: str, peer_key: str, call: Any) -> None:
        before, began = os.getloadavg()[0], time.time()
        for tries in (1, 2):
            try:
                results[scenario].append(call())
            except Disturbed as exc:
                if tries == 1:
                    log(f"  {peer_key}: {exc}; running it again")
                    continue
                results["errors"].append(
                    {"scenario": scenario, "peer": peer_key, "error": str(exc)}
                )
            except Exception as exc:
                traceback.print_exc()
                results["errors"].append(
                    {
                        "scenario": scenario,
                        "peer": peer_key,
                        "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                    }
                )
            break
        load.setdefault(scenario, []).extend([before, os.getloadavg()[0]])
        log(f"    ({time.time() - began:.0f} s, load {before:.2f} -> {os.getloadavg()[0]:.2f})")

    with tempfile.TemporaryDirectory(prefix="dsbench-") as tmp:
        services = Services(Path(tmp))
        try:
            if "skew" in args.scenarios:
                log(f"\n== skew: K = {plan['beats']}, {plan['skew_seconds']:.0f} s each")
                for k in plan["beats"]:
                    for peer in peers:
                        attempt(
                            "skew",
                            peer.key,
                            lambda p=peer, k=k: scenarios.skew(
                                services, p, k, plan["skew_seconds"], log
                            ),
                        )
            if "failover" in args.scenarios:
                log(f"\n== failover: bound {plan['failover_after']:.0f} s after the kill")
                for peer in peers:
                    for tuned in (False, True):
                        if tuned and (not plan["tuned"] or not peer.tuned):
                            continue
                        attempt(
                            "failover",
                            peer.key,
                            lambda p=peer, t=tuned: scenarios.failover(
                                services, p, t, plan["failover_before"], plan["failover_after"], log
                            ),
                        )
            if "scale" in args.scenarios:
                log(f"\n== scale: {plan['tasks']} entries, windows {plan['windows']}")
                for tasks in plan["tasks"]:
                    for peer in peers:
                        beats = plan["scale_beats"] if peer.key == "driftsafe" else 1
                        attempt(
                            "scale",
                            peer.key,
                            lambda p=peer, n=tasks, k=beats: scenarios.scale(
                                services,
                                p,
                                n,
                                plan["windows"][n],
                                plan["settle"],
                                log,
                                beats=k,
                                sql_seed=plan["sql_seed"] and p.key == "driftsafe",
                            ),
                        )
            if "edits" in args.scenarios:
                log(f"\n== edits: {plan['edits']} per scheduler")
                for peer in peers:
                    attempt(
                        "edits",
                        peer.key,
                        lambda p=peer: scenarios.edits(
                            services, p, plan["edits"], plan["edit_spacing"], log
                        ),
                    )
            if "burst" in args.scenarios:
                log(
                    f"\n== burst: {plan['burst_tasks']} entries due at one instant, ours with "
                    f"K = {plan['burst_beats']}, bound {plan['burst_bound']:.0f} s"
                )
                for tasks in plan["burst_tasks"]:
                    for peer in peers:
                        for k in plan["burst_beats"] if peer.key == "driftsafe" else [1]:
                            attempt(
                                "burst",
                                peer.key,
                                lambda p=peer, n=tasks, k=k: scenarios.burst(
                                    services, p, n, k, plan["burst_bound"], log
                                ),
                            )
            if "recovery" in args.scenarios:
                log(
                    f"\n== recovery: {plan['recovery_tasks']} entries back after "
                    f"{plan['outage_hours']:g} h"
                )
                for tasks in plan["recovery_tasks"]:
                    for peer in peers:
                        attempt(
                            "recovery",
                            peer.key,
                            lambda p=peer, n=tasks: scenarios.recovery(
                                services,
                                p,
                                n,
                                plan["outage_hours"] * 3600,
                                plan["recovery_bound"],
                                log,
                            ),
                        )
            machine = _machine(services.broker_url)
        finally:
            own_redis = services.own_redis
            services.close()

    results["meta"] = {
        "quick": args.quick,
        "machine": machine,
        "versions": _versions(),
        "started": started.strftime("%Y-%m-%d %H:%M UTC"),
        "finished": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "duration_min": (time.time() - began) / 60,
        "command": " ".join(["python -m benchmarks compare", *argv]),
        "peers": {p.key: {"shipped": p.shipped_note, "tuned": p.tuned_note} for p in peers},
        "offsets": list(scenarios.OFFSETS),
        "skew": {"entries": 30, "seconds": plan["skew_seconds"]},
        "failover": {"before": plan["failover_before"], "after": plan["failover_after"]},
        "scale": {
            "windows": {str(k): v for k, v in plan["windows"].items()},
            "settle": plan["settle"],
        },
        "edits": {"count": plan["edits"], "spacing": plan["edit_spacing"]},
        "burst": {"bound": plan["burst_bound"], "uptime": _uptime()},
        "recovery": {"outage_hours": plan["outage_hours"], "bound": plan["recovery_bound"]},
        "load": {k: (min(v), max(v)) for k, v in load.items()},
        "slot_mismatches": sum(
            r.get("slot_mismatches", 0) for s in ("skew", "scale", "burst") for r in results[s]
        ),
    }
    results["meta"]["limits"] = _limits(results, own_redis)
    return results


def _measured_at(meta: dict[str, Any], scenario: str) -> str:
    """When the saved measurement of ``scenario`` was started: its latest re-run's start, or
    the whole run's."""
    started = meta["started"]
    for rerun in meta.get("rerun", []):
        if scenario in rerun["scenarios"]:
            started = rerun["started"]
    return str(started)


def _merge(saved: dict[str, Any], fresh: dict[str, Any], rerun: list[str]) -> dict[str, Any]:
    """``saved`` with the scenarios in ``rerun`` replaced by ``fresh`` ones (all peers of a
    scenario are always measured together, so every table stays side by side)."""
    merged = dict(saved)
    meta = dict(saved["meta"])
    earlier = dict(saved.get("earlier", {}))
    for scenario in rerun:
        # the replaced measurement stays in the page, marked as such: nothing is dropped
        if saved.get(scenario):
            earlier[scenario] = {
                "rows": saved[scenario],
                "started": _measured_at(saved["meta"], scenario),
                "load": saved["meta"]["load"].get(scenario),
            }
        merged[scenario] = fresh[scenario]
        meta["load"] = {
            **meta["load"],
            **{k: v for k, v in fresh["meta"]["load"].items() if k == scenario},
        }
        for key in ("scale", "skew", "failover", "edits", "burst", "recovery"):
            if key == scenario:
                meta[key] = fresh["meta"][key]
    merged["errors"] = [
        e for e in saved.get("errors", []) if e["scenario"] not in rerun
    ] + fresh.get("errors", [])
    meta["rerun"] = [
        *meta.get("rerun", []),
        {
            "scenarios": rerun,
            "added": not any(saved.get(s) for s in rerun),
            "started": fresh["meta"]["started"],
            "finished": fresh["meta"]["finished"],
            "command": fresh["meta"]["command"],
        },
    ]
    meta["slot_mismatches"] = sum(
        r.get("slot_mismatches", 0) for s in ("skew", "scale", "burst") for r in merged.get(s, [])
    )
    merged["meta"] = meta
    merged["earlier"] = earlier
    meta["limits"] = _limits(
        merged, "redis-server was not found" not in " ".join(fresh["meta"]["limits"])
    )
    return merged


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.bench_settings")
    args = _parser().parse_args(argv)
    if args.render_only:
        docs = args.docs or ROOT / "docs"
        results = json.loads((docs / report.STATIC / "results.json").read_text())
        print(f"wrote {report.write_docs(results, docs, plot=False)}")
        return
    if args.report_only:
        results = json.loads(args.report_only.read_text())
    elif args.merge:
        results = _merge(json.loads(args.merge.read_text()), run(args, argv), args.scenarios)
    else:
        results = run(args, argv)
    print(report.tables(results))
    lines = report.ratios(results)
    if lines:
        print("\n== ratios (celery_driftsafe against each peer)")
        print("\n".join(f"- {line}" for line in lines))
    limits = results["meta"]["limits"]
    if limits:
        print("\n== not measured / bounds hit")
        print("\n".join(f"- {line}" for line in limits))
    if not args.no_docs:
        if args.docs is None:
            quick = results["meta"]["quick"]
            args.docs = (
                Path(tempfile.gettempdir()) / "dsbench-quick-docs" if quick else ROOT / "docs"
            )
        static = args.docs / report.STATIC
        static.mkdir(parents=True, exist_ok=True)
        if not args.report_only:
            (static / "results.json").write_text(json.dumps(results, indent=1))
        page = report.write_docs(results, args.docs)
        print(f"\nwrote {page} and plots under {static}")


def _scenario(name: str) -> Callable[[], None]:
    """``python -m benchmarks <scenario> ...``: the comparison with ``--scenarios <name>``;
    the page is written only with ``--docs`` or ``--merge`` (``compare`` writes it)."""

    def run_one() -> None:
        argv = sys.argv[1:]
        extra = ["--scenarios", name]
        if not any(a.startswith(("--docs", "--merge", "--report-only")) for a in argv):
            extra.append("--no-docs")
        main([*extra, *argv])

    run_one.__name__ = name
    return run_one


# python -m benchmarks <scenario> (benchmarks.REGISTRY)
skew = _scenario("skew")
failover = _scenario("failover")
scale = _scenario("scale")
edits = _scenario("edits")
burst = _scenario("burst")
recovery = _scenario("recovery")


if __name__ == "__main__":
    main()
