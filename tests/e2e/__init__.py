"""End-to-end harness: real ``celery beat`` processes against real databases and Redis."""
