"""The example shop's periodic tasks.

Each is a ``DriftSafeTask`` with late acknowledgement: a worker killed mid-run leaves its
message to be redelivered, and however often a run is delivered, its body runs once. Each
body records itself (``shop.models.Execution``) so that can be checked.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task

from celery_driftsafe.task import DriftSafeTask
from shop.models import Execution

logger = logging.getLogger(__name__)


@shared_task(
    name="shop.tasks.heartbeat",
    base=DriftSafeTask,
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
)
def heartbeat(self: Any) -> str:
    Execution.record(self.name, self.request)
    logger.info("heartbeat")
    return "ok"


@shared_task(
    name="shop.tasks.sync_inventory",
    base=DriftSafeTask,
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
)
def sync_inventory(self: Any, warehouse: str) -> str:
    Execution.record(self.name, self.request)
    logger.info("inventory of %s synced", warehouse)
    return f"inventory of {warehouse} synced"


@shared_task(
    name="shop.tasks.expire_carts",
    base=DriftSafeTask,
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
)
def expire_carts(self: Any, older_than_minutes: int = 30) -> int:
    Execution.record(self.name, self.request)
    logger.info("expired carts older than %d minutes", older_than_minutes)
    return 0


@shared_task(
    name="shop.tasks.sales_report",
    base=DriftSafeTask,
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
)
def sales_report(self: Any, region: str) -> str:
    Execution.record(self.name, self.request)
    logger.info("sales report for %s", region)
    return f"report for {region}"
