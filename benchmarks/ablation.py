"""The ablation of every speed mechanism: the burst, the steady load and the recovery with
every mechanism on, then with each one off in turn, in one run on one machine.

    python -m benchmarks ablation                          # everything, 3 repeats (hours)
    python -m benchmarks ablation --scenarios burst1 recovery --repeats 2
    python -m benchmarks ablation --only prebuild gc_freeze --tasks 20000
    python -m benchmarks ablation --only iso_texts,gc_freeze     # both off in one run
    python -m benchmarks ablation --only otel receivers --against ../before  # all on, beside
    python -m benchmarks ablation --table RESULTS_JSON     # the tables again, from a saved run

A mechanism is turned off through the benchmarks' own switch, ``DRIFTSAFE_BENCH_OFF``, which
``benchmarks/switches.py`` maps to the ``FAST_PUBLISH`` setting or to the constants a
project does not set (``CLAIM_PROCESS``, ``PUBLISH_BATCH_SIZE``, ``MIN_ROUND_INTERVAL_SECONDS``,
``OPTIMISATIONS_OFF``, in ``DRIFTSAFE_INTERNALS``).
Each repeat runs every configuration once, in an order rotated by one from the repeat
before, so that a machine getting slower or faster during the run is spread over all of
them rather than charged to the last ones; ``--baseline-every N`` runs the all-on
configuration again after every N others, for a measure of the noise within one repeat.

Scenarios (the comparison's own, ``benchmarks/scenarios.py``, celery_driftsafe only, rows
written by one statement): ``burst1`` and ``burst3``, every task due at one instant with one
and three beats (primary figure: the wave's time); ``steady``, the tasks' slots spread over
the minute with one beat (primary: p99 lateness); ``recovery``, one beat back after an outage
(primary: the time until every task has caught up). For each: beat CPU and PostgreSQL CPU a
slot, and the beat's largest RSS. Every run also counts duplicates, early and unsent slots:
a configuration that breaks them is reported, whatever its speed.

The noise of a figure is the spread (largest minus smallest, over the median) of the
all-on configuration's repeats. A mechanism earns its place when turning it off makes some
scenario's primary figure, or the beat's or PostgreSQL's CPU a slot, worse by more than that
figure's noise and by more than 5%. CPU a slot counts on its own because on this machine the
beats, PostgreSQL and the recorder share two cores, so a wave's time carries everything else
the machine does, where CPU a slot is what a beat on a core of its own would pay.

Results go to ``--out`` (JSON, written after every run, so an interrupted run keeps what it
measured); the tables are printed at the end, in the form docs/explanation/performance.md
shows them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks import scenarios
from benchmarks.peers import PEERS
from benchmarks.trial import ROOT, Services, pg_exec

#: Mechanisms switched by a setting of their own (benchmarks/switches.py maps the names).
SETTING_SWITCHES = {
    "fast_publish": "FAST_PUBLISH = False",
    "claim_process": "CLAIM_PROCESS = False",
    "publish_batch": "PUBLISH_BATCH_SIZE = 1",
    "round_interval": "MIN_ROUND_INTERVAL_SECONDS = 0",
}
SCENARIOS = ("burst1", "burst3", "steady", "recovery")
#: scenario -> (primary figure's key, its label, its unit)
PRIMARY = {
    "burst1": ("wave_s", "burst, 1 beat", "s"),
    "burst3": ("wave_s", "burst, 3 beats", "s"),
    "steady": ("p99_s", "steady p99", "s"),
    "recovery": ("wave_s", "back after the outage", "s"),
}
#: A mechanism must be worth more than this share of its scenario's primary figure.
LEAST_GAIN = 0.05
#: The configurations of ``--instrumented``, beside the mechanisms': what the beats' app
#: installs (``DRIFTSAFE_BENCH_TRACING``, benchmarks/bench_app.py) and the tables' label;
#: ``otel+NAME``: and the mechanism NAME off. ``receivers``: publish-signal receivers that do
#: nothing, so that the beat's own cost of having receivers and the instrumentation's own work
#: can be told apart.
TRACING = {
    "otel": ("opentelemetry", "instrumented (OpenTelemetry)"),
    "receivers": ("noop", "no-op publish-signal receivers"),
    "sentry": ("sentry", "Sentry's Celery integration"),
}
INSTRUMENTED_CONFIGS = ("otel", "otel+fast_publish", "receivers")


#: The configuration of ``--against``: everything on, the beats running another checkout's code.
AGAINST = "against"


def tracing(config: str | None) -> str | None:
    """The ``TRACING`` name a configuration begins with (None: a mechanism's or all on)."""
    first = (config or "").split("+")[0]
    return first if first in TRACING else None


def switched_off(config: str | None) -> str:
    """The mechanism a configuration turns off ("": none, as all on, ``against``, ``otel``)."""
    if config is None or config == AGAINST:
        return ""
    return config.removeprefix(tracing(config) or "").removeprefix("+")


def beside(config: str | None) -> bool:
    """Whether a configuration is shown beside the mechanisms, with no verdict of its own."""
    return config == AGAINST or tracing(config) is not None


def _known(config: str) -> bool:
    """Whether ``--only`` may name this configuration: a mechanism, several joined by commas
    (turned off together: small gains that the noise hides one at a time may add up), or a
    configuration of ``--instrumented``."""
    off = switched_off(config)
    if tracing(config) and off == "":
        return True
    return all(name in mechanisms() for name in off.split(","))


def mechanisms() -> list[str]:
    """Every switchable mechanism: the settings' four, then ``OPTIMISATIONS_OFF``'s names."""
    names = list(SETTING_SWITCHES)
    try:
        from celery_driftsafe.core.stored_names import Optimisation  # type: ignore[attr-defined]
    except ImportError:  # a version of the package before OPTIMISATIONS_OFF
        return names
    return names + [str(member.value) for member in Optimisation]


def switch_text(name: str) -> str:
    return SETTING_SWITCHES.get(name, f'OPTIMISATIONS_OFF = ["{name}"]')


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--baseline-every",
        type=int,
        default=0,
        help="run the all-on configuration again after every N others (more baseline runs "
        "for the noise when there are few repeats; 0: once a repeat)",
    )
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="mechanisms to turn off, each in a run of its own (default: every one; none: "
        "all on alone, with --instrumented or --against); NAME,NAME: those off together, in "
        "one run; also the configurations of --instrumented by name (otel, receivers, "
        "otel+NAME: NAME off with the instrumentation) and sentry (Sentry's Celery "
        "integration in the beats)",
    )
    parser.add_argument(
        "--instrumented",
        action="store_true",
        help="three configurations more: otel (OpenTelemetry's Celery instrumentation in "
        "the beats, everything on), otel+fast_publish (and the fast publish path off) and "
        "receivers (publish-signal receivers that do nothing)",
    )
    parser.add_argument(
        "--against",
        type=Path,
        default=None,
        metavar="CHECKOUT",
        help="one configuration more: everything on, the beats running the code of another "
        "checkout of the repository (an earlier commit's: git worktree add), whose "
        "migrations are this one's",
    )
    parser.add_argument(
        "--idle", type=float, default=30.0, help="seconds the beats are up before a burst"
    )
    parser.add_argument("--bound", type=float, default=55.0, help="seconds a burst may take")
    parser.add_argument("--steady-seconds", type=float, default=60.0)
    parser.add_argument("--settle", type=float, default=15.0)
    parser.add_argument("--outage-hours", type=float, default=24.0)
    parser.add_argument("--recovery-bound", type=float, default=120.0)
    parser.add_argument(
        "--out", type=Path, default=None, help="results JSON (default: a file in the temp dir)"
    )
    parser.add_argument(
        "--table", type=Path, default=None, help="print the tables of a saved run and exit"
    )
    return parser


def _figures(scenario: str, result: dict[str, Any]) -> dict[str, Any]:
    """What the ablation keeps of one scenario's result."""
    if scenario.startswith("burst"):
        sent = result["sent"]
        return {
            "wave_s": result["drain"],
            "p99_s": result["late_p99"],
            "beat_us": result["cpu_us_per_slot"],
            "pg_us": 1e6 * result["pg_cpu_s"] / sent if sent else None,
            "rss_mb": result["rss_mb"],
            "wrong": result["duplicates"] + result["early"] + result["unsent"],
        }
    if scenario == "steady":
        sent = result["sent"]
        return {
            "p99_s": None if result["late_p99_at_least"] else result["late_p99"],
            "beat_us": 1e6 * result["cpu_s"] / sent if sent else None,
            "pg_us": 1e6 * result["pg_cpu_s"] / sent if sent else None,
            "rss_mb": result["rss_mb"],
            "wrong": result["due"] - result["sent"],
        }
    messages = result["catch_up_messages"]
    return {
        "wave_s": result["all_caught_up"],
        "first_s": result["first_message"],
        "beat_us": 1e6 * result["cpu_s"] / messages if messages else None,
        "pg_us": 1e6 * result["pg_cpu_s"] / messages if messages else None,
        "rss_mb": result["rss_mb"],
        "wrong": result["tasks"] - result["caught_up"],
    }


def _run_one(
    services: Services, scenario: str, args: argparse.Namespace, log: Callable[[str], None]
) -> dict[str, Any]:
    peer = PEERS["driftsafe"]
    pg_exec("CHECKPOINT")  # no checkpoint of the run before's writes falls in this one
    if scenario in ("burst1", "burst3"):
        return scenarios.burst(
            services,
            peer,
            args.tasks,
            1 if scenario == "burst1" else 3,
            args.bound,
            log,
            sql_seed=True,
            idle=args.idle,
        )
    if scenario == "steady":
        return scenarios.scale(
            services, peer, args.tasks, args.steady_seconds, args.settle, log, sql_seed=True
        )
    return scenarios.recovery(
        services,
        peer,
        args.tasks,
        args.outage_hours * 3600,
        args.recovery_bound,
        log,
        sql_seed=True,
    )


def _commit_of(checkout: Path) -> str:
    """The commit a checkout holds (its path when git cannot tell)."""
    found = subprocess.run(
        ["git", "-C", str(checkout), "log", "-1", "--format=%h %s"],
        capture_output=True,
        text=True,
        check=False,
    )
    return found.stdout.strip() if found.returncode == 0 else str(checkout)


#: The machine's speed, as this page's figures have always stated it: a Python loop of 10^7
#: additions at a module's top level (names are globals there, as in ``python -c``).
SPEED_LOOP = "total = 0\nfor i in range(10**7):\n    total += i\n"


def _machine() -> dict[str, Any]:
    began = time.perf_counter()
    exec(SPEED_LOOP, {})
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loop_1e7_s": round(time.perf_counter() - began, 3),
        "load": os.getloadavg()[0],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    chosen = mechanisms() if args.only is None else args.only
    unknown = sorted(name for name in chosen if not _known(name))
    if unknown:
        raise SystemExit(f"unknown mechanism(s) {unknown}; known: {', '.join(mechanisms())}")
    names = [name for name in chosen if not tracing(name)]
    configs: list[str | None] = [None, *names]
    configs += [name for name in chosen if tracing(name)]
    if args.instrumented:
        configs += [name for name in INSTRUMENTED_CONFIGS if name not in configs]
    if args.against is not None:
        if not (args.against / "benchmarks" / "bench_settings.py").exists():
            raise SystemExit(f"--against {args.against}: not a checkout of this repository")
        configs.append(AGAINST)
    out = args.out or Path(tempfile.gettempdir()) / (
        f"ablation-{datetime.now(UTC):%Y%m%d-%H%M%S}.json"
    )
    results: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks ablation", *sys.argv[1:]]),
        "began": datetime.now(UTC).isoformat(timespec="seconds"),
        "tasks": args.tasks,
        "repeats": args.repeats,
        "scenarios": args.scenarios,
        "mechanisms": names,
        "against": _commit_of(args.against) if args.against is not None else None,
        "machine": [_machine()],
        "runs": [],
    }

    def log(text: str) -> None:
        print(text, flush=True)

    log(
        f"ablation: {len(configs)} configurations x {len(args.scenarios)} scenarios x "
        f"{args.repeats} repeats; results in {out}"
    )
    with tempfile.TemporaryDirectory(prefix="dsbench-") as tmp:
        services = Services(Path(tmp))
        try:
            for repeat in range(args.repeats):
                shift = repeat % len(configs)
                order = configs[shift:] + configs[:shift]
                if args.baseline_every:
                    others = [c for c in order if c is not None]
                    order = [None]
                    for i in range(0, len(others), args.baseline_every):
                        order += [*others[i : i + args.baseline_every], None]
                for config in order:
                    kind = tracing(config)
                    off = switched_off(config)
                    os.environ["DRIFTSAFE_BENCH_TRACING"] = TRACING[kind][0] if kind else ""
                    os.environ["DRIFTSAFE_BENCH_CODE"] = (
                        str(args.against.resolve()) if config == AGAINST else ""
                    )
                    os.environ["DRIFTSAFE_BENCH_OFF"] = off
                    for scenario in args.scenarios:
                        label = config or "all on"
                        log(f"\n[{repeat + 1}/{args.repeats}] {label}: {scenario}")
                        began = time.time()
                        try:
                            figures = _figures(scenario, _run_one(services, scenario, args, log))
                        except Exception as exc:  # one broken run does not end the others
                            traceback.print_exc()
                            figures = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                        results["runs"].append(
                            {
                                "repeat": repeat,
                                "off": config,
                                "scenario": scenario,
                                "seconds": round(time.time() - began, 1),
                                "load": os.getloadavg()[0],
                                **figures,
                            }
                        )
                        out.write_text(json.dumps(results, indent=1))
                results["machine"].append(_machine())
        finally:
            os.environ.pop("DRIFTSAFE_BENCH_OFF", None)
            os.environ.pop("DRIFTSAFE_BENCH_TRACING", None)
            os.environ.pop("DRIFTSAFE_BENCH_CODE", None)
            services.close()
    results["ended"] = datetime.now(UTC).isoformat(timespec="seconds")
    out.write_text(json.dumps(results, indent=1))
    return results


# -- the tables -------------------------------------------------------------------------------


def _values(runs: list[dict[str, Any]], off: str | None, scenario: str, key: str) -> list[float]:
    return [
        r[key]
        for r in runs
        if r["off"] == off and r["scenario"] == scenario and r.get(key) is not None
    ]


def _spread(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle else None


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """Per scenario: the all-on medians and noise; per mechanism and scenario: the medians
    with it off, the change of each figure, and whether it earns its place."""
    runs = results["runs"]
    table: dict[str, Any] = {"baseline": {}, "mechanisms": {}}
    for scenario in results["scenarios"]:
        key = PRIMARY[scenario][0]
        base = _values(runs, None, scenario, key)
        table["baseline"][scenario] = {
            "median": statistics.median(base) if base else None,
            "noise": _spread(base),
            "runs": len(base),
            "beat_us": _median(_values(runs, None, scenario, "beat_us")),
            "pg_us": _median(_values(runs, None, scenario, "pg_us")),
            "beat_noise": _spread(_values(runs, None, scenario, "beat_us")),
            "pg_noise": _spread(_values(runs, None, scenario, "pg_us")),
            "rss_mb": _median(_values(runs, None, scenario, "rss_mb")),
        }
    configs = [*results["mechanisms"]]
    configs += sorted({r["off"] for r in runs if beside(r["off"])})
    for name in configs:
        rows: dict[str, Any] = {}
        earns = False
        for scenario in results["scenarios"]:
            key = PRIMARY[scenario][0]
            base = table["baseline"][scenario]
            off = _values(runs, name, scenario, key)
            wrong = sum(
                r.get("wrong") or 0 for r in runs if r["off"] == name and r["scenario"] == scenario
            )
            errors = [
                r["error"]
                for r in runs
                if r["off"] == name and r["scenario"] == scenario and "error" in r
            ]
            middle = _median(off)
            change = (
                (middle - base["median"]) / base["median"]
                if middle is not None and base["median"]
                else None
            )
            gains = _beyond(change, base["noise"])
            beat = _change(_median(_values(runs, name, scenario, "beat_us")), base["beat_us"])
            pg = _change(_median(_values(runs, name, scenario, "pg_us")), base["pg_us"])
            beat_gains, pg_gains = _beyond(beat, base["beat_noise"]), _beyond(pg, base["pg_noise"])
            cpu_gains = beat_gains or pg_gains
            if not beside(name):
                earns = earns or gains or cpu_gains
            rows[scenario] = {
                "median": middle,
                "change": change,
                "gains": gains,
                "cpu_gains": cpu_gains,
                "beat_gains": beat_gains,
                "pg_gains": pg_gains,
                "beat_us": beat,
                "pg_us": pg,
                "rss_mb": _median(_values(runs, name, scenario, "rss_mb")),
                "wrong": wrong,
                "errors": errors,
            }
        table["mechanisms"][name] = {"scenarios": rows, "earns": earns}
    return table


def _beyond(change: float | None, noise: float | None) -> bool:
    """Whether turning a mechanism off made a figure worse by more than its noise and 5%."""
    return change is not None and change > max(noise or 0.0, LEAST_GAIN)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _change(value: float | None, base: float | None) -> float | None:
    return (value - base) / base if value is not None and base else None


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.0f}%"


def tables(results: dict[str, Any]) -> str:
    """The markdown tables of a run: the all-on figures with their noise, then one row a
    mechanism with each scenario's primary figure with it off and its change."""
    table = summary(results)
    scenarios_run = results["scenarios"]
    lines = [
        f"{results['tasks']:,} tasks, {results['repeats']} repeats, "
        f"{results['began']} to {results.get('ended', '(unfinished)')}; "
        f"a loop of 10^7 additions "
        + ", ".join(f"{m['loop_1e7_s']:.2f} s" for m in results["machine"])
        + (f"; against {results['against']}" if results.get("against") else ""),
        "",
        "| all on | " + " | ".join(PRIMARY[s][1] for s in scenarios_run) + " |",
        "|---|" + "---|" * len(scenarios_run),
    ]
    base = table["baseline"]

    def cell(b: dict[str, Any], key: str, unit: str) -> str:
        return "-" if b[key] is None else f"{b[key]:.3g} {unit}".strip()

    lines.append(
        "| primary figure (noise) | "
        + " | ".join(
            f"{cell(base[s], 'median', PRIMARY[s][2])} (±{100 * (base[s]['noise'] or 0) / 2:.0f}%)"
            for s in scenarios_run
        )
        + " |"
    )
    for key, label in (("beat_us", "beat CPU a slot"), ("pg_us", "PostgreSQL CPU a slot")):
        noise = "beat_noise" if key == "beat_us" else "pg_noise"
        lines.append(
            f"| {label} (noise) | "
            + " | ".join(
                f"{cell(base[s], key, 'µs')} (±{100 * (base[s][noise] or 0) / 2:.0f}%)"
                for s in scenarios_run
            )
            + " |"
        )
    lines.append(
        "| beat RSS | " + " | ".join(cell(base[s], "rss_mb", "MB") for s in scenarios_run) + " |"
    )
    lines += [
        "",
        "Each mechanism off in turn: the primary figure's change (beat CPU, PostgreSQL CPU "
        "a slot); **bold** where the primary figure's change is beyond its noise and 5%, "
        "*italic* a CPU figure beyond its own:",
        "",
        "| off | " + " | ".join(PRIMARY[s][1] for s in scenarios_run) + " | earns its place |",
        "|---|" + "---|" * (len(scenarios_run) + 1),
    ]
    for name, row in table["mechanisms"].items():
        cells = []
        for s in scenarios_run:
            r = row["scenarios"][s]
            beat, pg = _pct(r["beat_us"]), _pct(r["pg_us"])
            beat = f"*{beat}*" if r["beat_gains"] else beat
            pg = f"*{pg}*" if r["pg_gains"] else pg
            primary = _pct(r["change"])
            text = f"{f'**{primary}**' if r['gains'] else primary} ({beat}, {pg})"
            if r["wrong"]:
                text += f" {r['wrong']} wrong"
            if r["errors"]:
                text += f" {len(r['errors'])} failed"
            cells.append(text)
        verdict = "yes" if row["earns"] else "no"
        if kind := tracing(name):
            name, verdict = name.replace(kind, TRACING[kind][1], 1), "-"
        elif name == AGAINST:
            # the commit alone (its subject is in the line above the tables)
            name, verdict = f"the code of {results['against'].split()[0]} (all on)", "-"
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {verdict} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.table is not None:
        print(tables(json.loads(args.table.read_text())))
        return 0
    if not (ROOT / "benchmarks" / "bench_settings.py").exists():
        raise SystemExit("run from a checkout of the repository")
    results = run(args)
    print()
    print(tables(results))
    return 0
