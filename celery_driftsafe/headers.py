"""Names of the message headers a published run carries (see docs/reference/headers.md)."""

#: Id of the run's row in the ledger.
HEADER_RUN_ID = "driftsafe_run_id"
#: The slot, ISO 8601 in UTC (absent for manual and ad-hoc runs).
HEADER_SLOT = "driftsafe_slot"
#: The fencing token the run was claimed with.
HEADER_FENCING_TOKEN = "driftsafe_fencing_token"
#: Id of the periodic task (absent for ad-hoc runs).
HEADER_PERIODIC_TASK_ID = "driftsafe_periodic_task_id"

ALL = (HEADER_RUN_ID, HEADER_SLOT, HEADER_FENCING_TOKEN, HEADER_PERIODIC_TASK_ID)
