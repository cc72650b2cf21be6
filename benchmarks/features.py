"""The feature table of the comparison page: what each scheduler offers, by its own documentation.

Each peer's cell says what its documentation says, citing the page it says it on
(:data:`SOURCES`, numbered as the cells cite them); "measured below" points at the page's
tables. celery_driftsafe's cells name its setting, command or model field. Celery beat's
column is its own scheduler as shipped (``PersistentScheduler``, one beat). Temporal schedules
and Kubernetes CronJob are not Celery schedulers and are not in the measured tables; they are
here for their policies (overlap, catch-up, backfill, pausing, exclusions).
"""

from __future__ import annotations

#: The columns, in order: the key of each and its heading.
COLUMNS = (
    ("driftsafe", "celery_driftsafe"),
    ("celery-beat", "Celery beat"),
    ("django-celery-beat", "django-celery-beat"),
    ("redbeat", "RedBeat"),
    ("temporal", "Temporal schedules"),
    ("cronjob", "Kubernetes CronJob"),
)

#: Where each claim about a peer comes from: [n] in a cell is SOURCES[n - 1]. Checked against
#: these pages in December 2026.
SOURCES = (
    # [1] Celery's beat guide: one scheduler per schedule at a time, or duplicate tasks
    # (django-celery-beat's DatabaseScheduler and RedBeat's are such beats); the app's
    # ``timezone`` setting; the default scheduler keeps last run times in a local file
    # (``celerybeat-schedule``).
    "https://docs.celeryq.dev/en/stable/userguide/periodic-tasks.html",
    # [2] django-celery-beat's README: tasks managed in the Django admin; a PeriodicTask keeps
    # its last run time (``last_run_at``; with ``total_run_count``), no history of runs;
    # CrontabSchedule has a time zone of its own.
    "https://github.com/celery/django-celery-beat",
    # [3] RedBeat: a distributed lock keeps a second beat from running; the lock expires
    # unless refreshed, by default after 1500 s (25 min); an entry's hash holds its definition
    # and metadata (last run).
    "https://pypi.org/project/celery-redbeat/0.13.0",
    # [4] Temporal Schedules: spec with start/end, exclusions, jitter and a time zone; overlap
    # policy Skip (default), BufferOne, BufferAll, CancelOther, TerminateOther, AllowAll;
    # catchup window (default one year); backfill; pause; the Web UI.
    "https://docs.temporal.io/evaluate/features/schedules",
    # [5] Temporal Schedule: an action's timestamp is appended to its workflow id.
    "https://docs.temporal.io/schedule",
    # [6] temporal schedule backfill: the actions of a time range, with an overlap policy.
    "https://docs.temporal.io/cli/schedule",
    # [7] A schedule's description: its next 10 action times and 10 most recent actions.
    "https://rubydoc.info/gems/temporalio/Temporalio/Client/Schedule/Info",
    # [8] Temporal: a counter of actions skipped past the catchup window, to alert on.
    "https://docs.temporal.io/troubleshooting/schedule-missed-actions",
    # [9] Kubernetes CronJob: a job "approximately once" per schedule time, two or none in
    # some circumstances, so jobs should be idempotent; concurrencyPolicy Allow (default),
    # Forbid, Replace; startingDeadlineSeconds; more than 100 missed schedules: no job.
    "https://kubernetes.io/docs/concepts/workloads/controllers/cron-jobs/",
    # [10] The CronJob API: timeZone (default: the controller manager's), a job that missed
    # its start deadline counts as failed, successfulJobsHistoryLimit 3 and
    # failedJobsHistoryLimit 1 by default; ``suspend`` stops scheduling (set by hand).
    "https://kubernetes.io/docs/reference/kubernetes-api/workload-resources/cron-job-v1/",
)

#: (feature, {column key: cell}). A cell names its source as [n].
ROWS: tuple[tuple[str, dict[str, str]], ...] = (
    (
        "Several beats active at once",
        {
            "driftsafe": "yes: every beat claims; one run per slot (a unique row)",
            "celery-beat": "no: exactly one beat, or duplicate tasks [1]",
            "django-celery-beat": "no: one beat at a time, or duplicate tasks [1]",
            "redbeat": "no: one beat holds a Redis lock, the others wait [3]",
            "temporal": "n/a: the Temporal Service runs schedules itself [4]",
            "cronjob": "n/a: the CronJob controller runs them [9]",
        },
    ),
    (
        "Duplicate-free under clock skew",
        {
            "driftsafe": "yes: due on one authority's clock (measured below)",
            "celery-beat": "only with one beat [1]",
            "django-celery-beat": "only with one beat [1]; K beats send K copies (measured below)",
            "redbeat": "one active beat: no duplicates, early by its skew (measured below)",
            "temporal": "server-side; the workflow id carries the action's time [5]",
            "cronjob": "no: two jobs or none in some circumstances [9]",
        },
    ),
    (
        "Failover time",
        {
            "driftsafe": "none needed: the other beats claim on (measured below); a killed "
            "beat's unpublished runs after `LEASE_SECONDS`",
            "celery-beat": "none built in: one beat [1]",
            "django-celery-beat": "none built in: another beat started by hand or a supervisor [1]",
            "redbeat": "the lock's timeout: 25 min by default [3] (measured below)",
            "temporal": "the Temporal Service's own",
            "cronjob": "the control plane's own",
        },
    ),
    (
        "At-most-once execution on redelivery",
        {
            "driftsafe": "yes, with `DriftSafeTask`: a body starts once per attempt",
            "celery-beat": "no: Celery's delivery",
            "django-celery-beat": "no: Celery's delivery",
            "redbeat": "no: Celery's delivery",
            "temporal": "one workflow id per action [5]; activities retry",
            "cronjob": "no: jobs should be idempotent [9]",
        },
    ),
    (
        "Misfire / catch-up policies",
        {
            "driftsafe": "fire once, fire all (bounded), skip; a grace per task",
            "celery-beat": "none",
            "django-celery-beat": "none",
            "redbeat": "none",
            "temporal": "catchup window, default one year [4]",
            "cronjob": "`startingDeadlineSeconds`; no job after 100 missed [9]",
        },
    ),
    (
        "Overlap policies",
        {
            "driftsafe": "allow, skip, buffer one, buffer all (ten waiting at most), replace "
            "(terminating the body where the pool can)",
            "celery-beat": "none",
            "django-celery-beat": "none",
            "redbeat": "none",
            "temporal": "skip, buffer one, buffer all, cancel other, terminate other, allow "
            "all [4]",
            "cronjob": "`concurrencyPolicy`: allow, forbid, replace [9]",
        },
    ),
    (
        "Pause after repeated failures",
        {
            "driftsafe": "per-task `pause_after_failures`: disabled after N failed or missed "
            "runs in a row, with the reason, a signal and a metric",
            "celery-beat": "no",
            "django-celery-beat": "no",
            "redbeat": "no",
            "temporal": "pause on failure: paused after one failed action [4]",
            "cronjob": "no: `suspend` is set by hand [10]",
        },
    ),
    (
        "Excluded dates / holiday calendars",
        {
            "driftsafe": "per task `excluded_dates`, and calendars shared by tasks (dates, a "
            "crontab of excluded times); excluded slots never fire nor count missed",
            "celery-beat": "no",
            "django-celery-beat": "no",
            "redbeat": "no",
            "temporal": "exclusions in the schedule spec (calendar specs) [4]",
            "cronjob": "no",
        },
    ),
    (
        "Backfill of a past range",
        {
            "driftsafe": "yes: `driftsafe_backfill`, admin action; each slot at most once",
            "celery-beat": "no",
            "django-celery-beat": "no",
            "redbeat": "no",
            "temporal": "yes, with an overlap policy [6]",
            "cronjob": "no",
        },
    ),
    (
        "Preview of next slots before saving",
        {
            "driftsafe": "yes: a button on the admin form (`driftsafe_status` for saved tasks)",
            "celery-beat": "no",
            "django-celery-beat": "no",
            "redbeat": "no",
            "temporal": "after saving: the next 10 action times [7]",
            "cronjob": "no",
        },
    ),
    (
        "Deadlines / dead man's switch alerts",
        {
            "driftsafe": "per-task `deadline_seconds`: late flag, Django signal, metrics, "
            "stale flag",
            "celery-beat": "no",
            "django-celery-beat": "no",
            "redbeat": "no",
            "temporal": "a namespace-wide counter of missed actions [8]",
            "cronjob": "a job past its start deadline counts as failed [10]",
        },
    ),
    (
        "Admin UI",
        {
            "driftsafe": "Django admin: tasks, runs, nodes, dashboard",
            "celery-beat": "no: `beat_schedule` in code [1]",
            "django-celery-beat": "Django admin [2]",
            "redbeat": "no: entries in Redis [3]",
            "temporal": "Temporal Web UI [4]",
            "cronjob": "no: kubectl [9]",
        },
    ),
    (
        "Time zones / DST",
        {
            "driftsafe": "per task (IANA); DST gaps and folds handled and previewed",
            "celery-beat": "the app's `timezone` [1]",
            "django-celery-beat": "per crontab schedule [2]",
            "redbeat": "the app's `timezone` [1]",
            "temporal": "per schedule spec [4]",
            "cronjob": "`timeZone`, default the controller manager's [10]",
        },
    ),
    (
        "Jitter",
        {
            "driftsafe": "yes: `jitter_seconds`, the same instant on every beat",
            "celery-beat": "no",
            "django-celery-beat": "no",
            "redbeat": "no",
            "temporal": "yes [4]",
            "cronjob": "no",
        },
    ),
    (
        "Run history",
        {
            "driftsafe": "a run per slot with its attempts and outcome",
            "celery-beat": "last run times in a local file [1]",
            "django-celery-beat": "last run time and count [2]",
            "redbeat": "last run time [3]",
            "temporal": "10 most recent actions [7]; workflow histories",
            "cronjob": "finished Jobs: 3 succeeded, 1 failed kept by default [10]",
        },
    ),
)
