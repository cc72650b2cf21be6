from datetime import datetime

from django.contrib import admin

from shop.models import Execution


def _precise(instant: datetime | None) -> str:
    return "-" if instant is None else instant.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


@admin.register(Execution)
class ExecutionAdmin(admin.ModelAdmin):
    """Read-only: the rows are what the task bodies wrote."""

    list_display = ["task_name", "slot_utc", "executed_utc", "worker", "run_id"]
    list_filter = ["task_name", "worker"]
    search_fields = ["celery_task_id"]

    @admin.display(description="slot", ordering="slot")
    def slot_utc(self, execution: Execution) -> str:
        return _precise(execution.slot)

    @admin.display(description="executed at (worker clock)", ordering="executed_at")
    def executed_utc(self, execution: Execution) -> str:
        return _precise(execution.executed_at)

    def has_add_permission(self, request):  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False
