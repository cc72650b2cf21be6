"""The project's Celery app, as celery_driftsafe finds it: the app installed with
:func:`set_celery_app` (tests, or a project that wants to be explicit), else
``DRIFTSAFE['CELERY_APP']`` (a dotted path), else ``celery.current_app``.

Forms and the admin check task names against its registry; run now publishes through it.

Celery imports a project's task modules (those ``autodiscover_tasks()`` finds, ``imports`` /
``CELERY_IMPORTS``, ``include``) when a worker or a beat starts, never when the app is
imported: a web process that never ran a worker knows only the tasks of the modules it
happened to import. :func:`load_task_modules` imports them as the worker does, once per app
and process, and everything here that reads the app's registry calls it first.
"""

from __future__ import annotations

import contextlib
import re
import threading
import weakref
import zoneinfo
from collections.abc import Iterator
from importlib import import_module
from typing import Any

from celery_driftsafe.conf import get_settings
from celery_driftsafe.exceptions import ConfigurationError, TaskModulesError

_app_override: Any = None
#: The apps whose task modules :func:`load_task_modules` imported in this process.
_loaded: weakref.WeakSet[Any] = weakref.WeakSet()
_loading = threading.RLock()  # a task module that asks for the names meanwhile


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


def load_task_modules(app: Any | None = None) -> Any:
    """Import the task modules of ``app`` (default :func:`get_celery_app`) as its worker and
    beat do at their start, once per app and process; returns the app.

    This is Celery's ``app.loader.import_default_modules()``, which ``celery worker``,
    ``celery beat``, ``celery shell`` and ``celery report`` call: it sends Celery's
    ``import_modules`` signal (on which ``autodiscover_tasks()`` waits, and Celery's Django
    fix-up, which runs Django's system checks unless ``CELERY_SKIP_CHECKS`` is set), then
    imports ``imports`` and ``include``. An app whose worker or beat runs in this process is
    left alone (its modules are in). The fix-up also calls ``django.setup()`` first, for a
    worker that starts Django there; in a process where Django is already set up (a web
    process) that call is skipped: a second set-up would configure logging again (with
    ``disable_existing_loggers`` every logger made since start-up would fall silent) and reset
    the URL prefix of the request being served.

    A module that fails to import raises :class:`TaskModulesError` naming it, and the next call
    tries again (a fixed module is then found without a restart)."""
    app = app if app is not None else get_celery_app()
    loader = getattr(app, "loader", None)
    if loader is None or app in _loaded:
        return app
    with _loading:
        if app in _loaded:
            return app
        if not getattr(loader, "worker_initialized", False):
            try:
                with _django_set_up_once():
                    loader.import_default_modules()
            except Exception as exc:
                raise TaskModulesError(failed_module(exc), exc) from exc
        _loaded.add(app)
    return app


@contextlib.contextmanager
def _django_set_up_once() -> Iterator[None]:
    """While it lasts, ``django.setup()`` does nothing if Django is set up already (called
    under :data:`_loading`; nothing else in a running process sets Django up)."""
    import django
    from django.apps import apps

    if not apps.ready:
        yield
        return
    setup = django.setup
    django.setup = _already_set_up
    try:
        yield
    finally:
        django.setup = setup


def _already_set_up(set_prefix: bool = True) -> None:
    """``django.setup`` for a process whose Django is set up: nothing to do."""


def failed_module(exc: BaseException) -> str:
    """Which task module an import failed in, quoted (``'demoapp.tasks'``): the first module
    the traceback was executing (the one Celery asked for; an error in a module it imports
    is named in the exception), else the module that was not found, else the file that does
    not compile; empty when none of them can be told."""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "<module>":
            return repr(frame.f_globals.get("__name__", frame.f_code.co_filename))
        tb = tb.tb_next
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return repr(exc.name)
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"at {exc.filename}"
    return ""


def registered_task_names(app: Any | None = None, *, load: bool = True) -> list[str]:
    """Names of the tasks registered with ``app`` (default :func:`get_celery_app`), sorted,
    without Celery's own ``celery.*`` tasks; first, with ``load``, its task modules are
    imported (:func:`load_task_modules`, whose :class:`TaskModulesError` passes through)."""
    app = app if app is not None else get_celery_app()
    if load:
        load_task_modules(app)
    return sorted(name for name in app.tasks if not name.startswith("celery."))


def argument_problem(app: Any, name: str, args: Any, kwargs: Any) -> str | None:
    """Why the task ``name`` of ``app`` cannot be called with ``args`` and ``kwargs``, as
    Celery's own check at publish says (the task's ``__header__``, a function of the task's
    signature, which ``apply_async`` calls for a task with ``typing`` on): the message names the
    argument and the signature. None when it can, when ``app`` does not have the task (nothing
    can be said of a name another process registers), or when the task turned the check off.
    A task taking ``**kwargs`` takes any keyword."""
    import inspect

    task = app.tasks.get(name)
    check = getattr(task, "__header__", None)
    if task is None or check is None or not getattr(task, "typing", True):
        return None
    try:
        check(*args, **kwargs)
    except TypeError as exc:
        try:
            full = inspect.signature(task.run)
        except (TypeError, ValueError):
            signature = "(...)"
        else:  # the parameters' names and defaults: what a caller passes
            empty = inspect.Parameter.empty
            signature = str(
                full.replace(
                    parameters=[p.replace(annotation=empty) for p in full.parameters.values()],
                    return_annotation=empty,
                )
            )
        detail = re.sub(r"^\w+\(\) ", "", str(exc))  # the header function's own name
        return f"{name}{signature} cannot be called with these arguments: {detail}"
    return None


def app_time_zone(app: Any | None = None) -> str:
    """The time zone Celery evaluates ``app``'s crontabs in (default :func:`get_celery_app`),
    as an IANA name: its ``timezone`` setting, which with Django's configuration is
    ``CELERY_TIMEZONE``, else Django's ``TIME_ZONE`` (Celery reads both). ``"UTC"`` when the
    app sets none (with ``enable_utc`` off Celery would then use the machine's local time,
    which has no name to store), names a zone this Python does not know, or cannot be
    loaded."""
    try:
        app = app if app is not None else get_celery_app()
        setting = app.conf.timezone
    except Exception:
        return "UTC"
    name = getattr(setting, "key", setting)  # a ZoneInfo given instead of a name
    if not isinstance(name, str) or not name:
        return "UTC"
    try:
        zoneinfo.ZoneInfo(name)
    except (ValueError, zoneinfo.ZoneInfoNotFoundError):
        return "UTC"
    return name


#: What :func:`app_argument` says when it cannot name the app.
APP_PLACEHOLDER = "<the module of your Celery app>"


def app_argument(app: Any | None = None) -> str:
    """What ``celery -A`` takes to find the project's app (default :func:`get_celery_app`), for
    hints: ``DRIFTSAFE['CELERY_APP']`` when set, else the app's main name when Celery finds
    this very app from it (``proj`` in the layout of Celery's Django guide), else
    :data:`APP_PLACEHOLDER`."""
    path = get_settings().celery_app
    if path:
        return str(path)
    try:
        app = app if app is not None else get_celery_app()
        main = app.main
        if main and main != "__main__":
            from celery.app.utils import find_app

            if find_app(main) is app:
                return str(main)
    except Exception:  # whatever the main name is, it does not lead to this app
        pass
    return APP_PLACEHOLDER
