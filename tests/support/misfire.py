"""Seeing how the misfire planner planned: whether it walked a task's slots."""

from __future__ import annotations

from typing import Any

import pytest

from celery_driftsafe.core import misfire


def count_walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets one entry each time a plan walks its slots (for the test's life)."""
    walks: list[int] = []
    walk = misfire._walk_due

    def counting(*args: Any) -> Any:
        walks.append(1)
        return walk(*args)

    monkeypatch.setattr(misfire, "_walk_due", counting)
    return walks
