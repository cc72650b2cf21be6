"""Whether a method of Celery or kombu is the library's own, as its source defines it, or one
installed over it: a subclass's override, or a wrapper put in its place at run time (Sentry's,
Elastic APM's and OpenTracing's integrations replace ``Task.apply_async``, ``Celery.send_task``
or kombu's ``Producer.publish`` on the class). The fast publish path
(:mod:`celery_driftsafe.publish.fast_path`) reproduces what those methods do, so it steps aside
wherever one of them is not the library's own: the wrapper then runs for every message.

Comparing with the class attribute (``type(task).apply_async is Task.apply_async``) cannot tell:
after ``Task.apply_async = wrapper(Task.apply_async)`` both sides are the wrapper. What a
function's code object says cannot be changed that way: a wrapper's code is its own (its file,
its name), even where ``functools.wraps`` copied the wrapped function's name, module and
docstring (and set ``__wrapped__``, which the library's own methods never have).
"""

from __future__ import annotations

import sys
from typing import Any


def is_original(function: Any, module: str, qualname: str) -> bool:
    """Whether ``function`` (a function or a bound method) is the one the source of module
    ``module`` defines as ``qualname`` (``"Task.apply_async"``), not wrapped or replaced."""
    function = getattr(function, "__func__", function)
    code = getattr(function, "__code__", None)
    if code is None or hasattr(function, "__wrapped__"):
        return False
    source = sys.modules.get(module)
    return (
        source is not None
        and code.co_qualname == qualname
        and code.co_filename == getattr(source, "__file__", None)
    )
