"""The project's Celery app, as celery_driftsafe finds it: the app installed with
:func:`set_celery_app` (tests, or a project that wants to be explicit), else
``DRIFTSAFE['CELERY_APP']`` (a dotted path), else ``celery.current_app``.

Forms and the admin check task names against its registry; run now publishes through it.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from celery_driftsafe.conf import get_settings
from celery_driftsafe.exceptions import ConfigurationError

_app_override: Any = None


def set_celery_app(app: Any) -> None:
    """Use ``app`` for task-name validation and manual runs (``None``: back to the default)."""
    global _app_override
    _app_override = app


def load_celery_app(path: str) -> Any:
    """Import the Celery app ``path`` names: ``"proj.celery:app"`` or ``"proj.celery.app"``."""
    module_name, colon, attribute = path.partition(":")
    if not colon:
        module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise ConfigurationError(
            "CELERY_APP", path, "is not a dotted path", "write e.g. 'proj.celery:app'"
        )
    try:
        app = getattr(import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(
            "CELERY_APP", path, f"cannot be imported: {exc}", "check the module and name"
        ) from exc
    if not hasattr(app, "tasks") or not hasattr(app, "send_task"):
        raise ConfigurationError("CELERY_APP", path, "is not a Celery app")
    return app


def get_celery_app() -> Any:
    """The Celery app whose task registry the admin checks and that publishes manual runs."""
    if _app_override is not None:
        return _app_override
    path = get_settings().celery_app
    if path:
        return load_celery_app(path)
    from celery import current_app

    return current_app._get_current_object()


def registered_task_names(app: Any | None = None) -> list[str]:
    """Names of the tasks registered with ``app`` (default :func:`get_celery_app`), sorted,
    without Celery's own ``celery.*`` tasks."""
    app = app if app is not None else get_celery_app()
    return sorted(name for name in app.tasks if not name.startswith("celery."))
