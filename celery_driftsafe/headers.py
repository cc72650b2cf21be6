"""Moved to :mod:`celery_driftsafe.core.headers`. This path, which 0.2's guides named, still
works with a ``DeprecationWarning`` and goes in a later release."""

from celery_driftsafe._moved import forward

__getattr__ = forward(__name__, "celery_driftsafe.core.headers")
