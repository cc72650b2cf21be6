"""celery_driftsafe's benchmarks: one tool, ``python -m benchmarks <name> [options]``.

:data:`REGISTRY` names every benchmark: ``name -> ("module:function", one line of help)``.
The function is called with ``sys.argv`` set to ``["python -m benchmarks <name>", *options]``,
so a module's ``main()`` parses its own options with argparse as usual. A new benchmark is a
module ``benchmarks/<name>.py`` with a ``main()`` and one line here (see benchmarks/README.md).
Importing this package imports nothing else: each benchmark sets up Django its own way.
"""

from __future__ import annotations

#: name -> ("module:function", help). Scenario names of the comparison run that scenario
#: beside the peers (``compare --scenarios <name>``); see benchmarks/README.md.
REGISTRY: dict[str, tuple[str, str]] = {
    "compare": (
        "benchmarks.compare:main",
        "the comparison beside django-celery-beat and RedBeat (writes "
        "docs/comparison.md); every scenario below in one run",
    ),
    "skew": (
        "benchmarks.compare:skew",
        "comparison scenario: K skewed beats, duplicates, misses, early and late messages",
    ),
    "failover": (
        "benchmarks.compare:failover",
        "comparison scenario: SIGKILL the beat that published last",
    ),
    "scale": (
        "benchmarks.compare:scale",
        "comparison scenario: steady load, N entries spread over the minute",
    ),
    "edits": (
        "benchmarks.compare:edits",
        "comparison scenario: schedule edits reaching running beats",
    ),
    "burst": (
        "benchmarks.compare:burst",
        "comparison scenario: N entries due at one "
        "instant, ours with 1 and 3 beats beside the peers",
    ),
    "recovery": (
        "benchmarks.compare:recovery",
        "comparison scenario: back after an outage with no beat running",
    ),
    "ablation": (
        "benchmarks.ablation:main",
        "every speed mechanism off in turn: burst (1 and 3 beats), steady, recovery; "
        "what each buys beside the noise",
    ),
    "burst-profile": (
        "benchmarks.bench_burst:main",
        "in-process burst: where a slot's time goes per stage, --profile, --ledger N, --explain",
    ),
    "reconcile": (
        "benchmarks.bench_reconcile:main",
        "plain tasks' runs settled by reconciliation (expired, from the result backend)",
    ),
    "statements": ("benchmarks.statements:main", "statements one claim round issues"),
    "claim-insert": (
        "benchmarks.claim_insert:main",
        "the claim's insert, plain against ON CONFLICT DO NOTHING: backend CPU a run",
    ),
    "hot-mark": (
        "benchmarks.hot_mark:main",
        "the run table's insert and mark as they are, and as a HOT mark would need them",
    ),
    "task": ("benchmarks.bench_task:main", "DriftSafeTask overhead over a plain task"),
    "slots": ("benchmarks.bench_slots:main", "slot arithmetic: microseconds per call"),
    "jitter": (
        "benchmarks.bench_jitter:main",
        "a wave of tasks due at one instant, claimed "
        "with and without a deterministic jitter: due per second, claim time",
    ),
    "retention": (
        "benchmarks.bench_retention:main",
        "a day of runs in the ledger pruned "
        "while the claim loop claims: claim latency before/during/after, sizing",
    ),
    "admin": (
        "benchmarks.bench_admin:main",
        "the admin's run and task lists and filters with millions of runs on PostgreSQL",
    ),
    "dashboard": (
        "benchmarks.bench_dashboard:main",
        "the admin's cluster dashboard and the "
        "metrics view on a big ledger; what a metrics hook costs off and on",
    ),
    "soak": (
        "benchmarks.soak:main",
        "a beat and a worker for --minutes: memory and lateness sampled; exit 1 when they grow",
    ),
}
