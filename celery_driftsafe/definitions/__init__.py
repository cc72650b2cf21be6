"""Keeping task definitions right: a task's next slot when it is created, edited or re-enabled, the
create-or-update by name, Celery's ``beat_schedule`` mirrored into rows, and what
``driftsafe_import`` reads."""
