"""A paginator for the run ledger that never counts a big table.

``COUNT(*)`` reads every row (or every index entry) it counts: on a ledger of millions of runs
that alone takes seconds, on every page. :class:`EstimatedCountPaginator` counts instead

* the unfiltered list on PostgreSQL: the planner's row estimate of the table
  (``pg_class.reltuples``, kept current by autovacuum and ``ANALYZE``), when it is above
  :attr:`~EstimatedCountPaginator.count_limit`;
* anything else: at most ``count_limit + 1`` rows (``SELECT count(*) FROM (… LIMIT n)``), so the
  count is exact below the limit and "more than the limit" above it: the pages beyond it are
  reached by narrowing the filters, not by paging.

Use it with ``show_full_result_count = False`` (no count of the unfiltered list either).
"""

from __future__ import annotations

from typing import Any

from django.core.paginator import Paginator
from django.db import connections
from django.utils.functional import cached_property


def estimated_rows(model: Any, using: str) -> int | None:
    """PostgreSQL's estimate of ``model``'s table size; None elsewhere, or never analysed."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT reltuples::bigint FROM pg_class WHERE oid = to_regclass(%s)",
            [connection.ops.quote_name(model._meta.db_table)],
        )
        row = cursor.fetchone()
    if row is None or row[0] is None or row[0] < 0:  # -1: never vacuumed nor analysed
        return None
    return int(row[0])


class EstimatedCountPaginator(Paginator):  # type: ignore[type-arg]
    """See the module docstring."""

    #: Counted exactly up to this many rows.
    count_limit = 10_000

    @cached_property
    def count(self) -> int:
        queryset: Any = self.object_list
        if not hasattr(queryset, "query"):
            return len(queryset)
        if not queryset.query.where:
            estimate = estimated_rows(queryset.model, queryset.db)
            if estimate is not None and estimate > self.count_limit:
                return estimate
        counted: int = queryset.order_by()[: self.count_limit + 1].count()
        return counted
