"""celery_driftsafe: several Celery beats, clocks apart, every periodic slot exactly once.

The package is a Django app (add ``"celery_driftsafe"`` to ``INSTALLED_APPS``) and a Celery
beat scheduler (``celery_driftsafe.scheduler:DriftSafeScheduler``).
"""

__version__ = "0.2.0"
