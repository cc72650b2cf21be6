"""A run in the worker: one delivery's execution under the ledger and its locks, the request class
and signals of a worker's main process, and the receivers of plain tasks."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("celery_driftsafe.task")


def log_run(level: int, message: str, *args: Any, run_id: int, action: str, **extra: Any) -> None:
    """Log about one run, with the run's id and the action in the record's extras."""
    logger.log(level, message, *args, extra={"action": action, "run": run_id, **extra})
