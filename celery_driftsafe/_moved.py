"""The paths that 0.2's guides named for modules that have since moved into the layers: each
old module forwards its names to the new one, warning once per name it is asked for."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def forward(old: str, new: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``old`` that returns ``new``'s attribute ``name`` with a
    ``DeprecationWarning`` naming the new path (the package's top level for a public name; an
    attribute ``new`` lacks is an ``AttributeError`` naming ``old``, as for any module)."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # dunder lookups (import machinery, tools) are not uses
            raise AttributeError(name)
        value = getattr(importlib.import_module(new), name, _MISSING)
        if value is _MISSING:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        import celery_driftsafe

        # a public name is named where the public API has it (the package's top level)
        where = "celery_driftsafe" if name in celery_driftsafe.__all__ else new
        warnings.warn(
            f"{old}.{name} has moved to {where}.{name}; {old} goes in a later release",
            DeprecationWarning,
            stacklevel=2,
        )
        return value

    return __getattr__


_MISSING = object()
