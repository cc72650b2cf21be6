"""The display forms of a task's arguments (``argsrepr``/``kwargsrepr``) as Celery writes
them, cheaply where that is provably the same string."""

from __future__ import annotations

from typing import Any

from celery.utils.saferepr import saferepr


def repr_limits(app: Any) -> tuple[int, int, int]:
    """``app``'s bounds of the display forms: ``argsrepr``'s and ``kwargsrepr``'s size, and
    the depth (reading the configuration costs more than a plain display form: a caller that
    builds many asks once)."""
    amqp = app.amqp
    return amqp.argsrepr_maxsize, amqp.kwargsrepr_maxsize, app.conf.get("task_repr_maxlevels", 3)


def argument_reprs(
    app: Any, args: Any, kwargs: Any, limits: tuple[int, int, int] | None = None
) -> tuple[str, str]:
    """``argsrepr`` and ``kwargsrepr`` of a message of ``app`` with these arguments
    (``limits``: :func:`repr_limits` of ``app``, when the caller has them). As Celery's
    ``as_task_v2`` writes them: no arguments are ``()`` and ``{}``, whether ``[]`` or ``()``
    (Celery's beat passes ``[]`` for an entry without arguments)."""
    args_size, kwargs_size, levels = limits or repr_limits(app)
    return (
        display_form(args or (), args_size, levels),
        display_form(kwargs or {}, kwargs_size, levels),
    )


def display_form(value: Any, maxsize: int, maxlevels: int) -> str:
    """Celery's display form of task arguments (``saferepr``, for ``argsrepr`` and
    ``kwargsrepr``), with a shortcut: for plain values (numbers, booleans, None, strings of
    printable characters without quotes or backslashes, in lists and string-keyed dicts at
    most two deep) whose ``repr`` fits, the two are the same string, and ``repr`` costs a
    tenth."""
    if maxlevels >= 3 and _plain(value, 0):
        text = repr(value)
        if len(text) < maxsize:
            return text
    return str(saferepr(value, maxsize, maxlevels=maxlevels))


_PLAIN_SCALARS = (int, float, bool, type(None))


def _plain(value: Any, depth: int) -> bool:
    kind = type(value)
    if kind is str:
        return value.isprintable() and "'" not in value and '"' not in value and "\\" not in value
    if kind in _PLAIN_SCALARS:
        return True
    if depth >= 2:
        return False
    if kind is list:
        return all(_plain(item, depth + 1) for item in value)
    if kind is dict:
        return all(
            type(key) is str and _plain(key, depth + 1) and _plain(item, depth + 1)
            for key, item in value.items()
        )
    return False
