"""The example's periodic tasks."""

import logging

from celery import shared_task

logger = logging.getLogger(__name__)


@shared_task(name="shop.tasks.heartbeat")
def heartbeat() -> str:
    logger.info("heartbeat")
    return "ok"


@shared_task(name="shop.tasks.sales_report")
def sales_report(region: str) -> str:
    logger.info("sales report for %s", region)
    return f"report for {region}"
