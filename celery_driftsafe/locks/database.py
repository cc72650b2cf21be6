"""The database lock backend: one row per name, taken over by a conditional UPDATE."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from celery_driftsafe.exceptions import LockError
from celery_driftsafe.locks.contract import DEFAULT_TTL
from celery_driftsafe.locks.lease import _LeaseLock
from celery_driftsafe.store.clock import AuthorityClock, Clock, DatabaseAuthority


class DatabaseLockBackend:
    """Locks as rows of :class:`celery_driftsafe.models.Lock` on database ``using``.

    ``clock.now()`` decides expiry, so every process must use the same authority; the default
    is the database server's clock. A lease is over *at* ``expires_at``: a lock whose
    ``expires_at`` equals ``now`` can be taken over, and its holder can no longer extend or
    release it. Lock calls commit on their own, so they refuse to run inside a transaction on
    ``using`` (take the lock first, then open the transaction). On SQLite, writers take turns:
    a long write transaction elsewhere delays acquisitions and renewals.
    """

    def __init__(self, *, clock: Clock | None = None, using: str = "default") -> None:
        self.using = using
        self.clock: Clock = clock if clock is not None else AuthorityClock(DatabaseAuthority(using))

    def lock(
        self, name: str, ttl: float = DEFAULT_TTL, *, fencing_floor: int = 0, holder: str = ""
    ) -> DatabaseLock:
        return DatabaseLock(self, name, ttl, fencing_floor=fencing_floor, holder=holder)


class DatabaseLock(_LeaseLock):
    """A :class:`DistributedLock` in the database; see :class:`DatabaseLockBackend`."""

    def __init__(
        self,
        backend: DatabaseLockBackend,
        name: str,
        ttl: float = DEFAULT_TTL,
        *,
        fencing_floor: int = 0,
        holder: str = "",
    ) -> None:
        super().__init__(name, ttl, backend.clock, fencing_floor, holder)
        self.using = backend.using

    def _rows(self) -> Any:
        from celery_driftsafe.models import Lock as LockRow

        return LockRow.objects.using(self.using).filter(name=self.name)

    def _outside_transaction(self) -> None:
        from django.db import connections

        if connections[self.using].in_atomic_block:
            raise LockError(
                f"lock {self.name!r}: database locks must be taken, extended and released "
                "outside a transaction (others would not see the lock until it commits)"
            )

    def _acquire_token(
        self, token: str, ttl: float, heir: str | None = None, holder: str | None = None
    ) -> int | None:
        from django.db import DatabaseError, transaction
        from django.db.models import F, Q, Value
        from django.db.models.functions import Greatest

        from celery_driftsafe.models import Lock as LockRow

        self._outside_transaction()
        now = self.clock.now()
        expires_at = now + timedelta(seconds=ttl)
        try:
            with transaction.atomic(using=self.using):
                # Take over a free or expired row (or the one handed to ``heir``). On
                # PostgreSQL a concurrent taker waits on the row lock and then re-checks the
                # condition against the new row: one wins.
                if holder is not None:
                    takeable = Q(token__startswith=f"{holder}#", expires_at__gt=now)
                elif heir is not None:
                    takeable = Q(token=heir, expires_at__gt=now)
                else:
                    takeable = Q(token="") | Q(expires_at__lte=now)
                taken = (
                    self._rows()
                    .filter(takeable)
                    .update(
                        token=token,
                        fencing_token=Greatest(
                            F("fencing_token") + 1, Value(self.fencing_floor + 1)
                        ),
                        expires_at=expires_at,
                    )
                )
                if not taken and heir is None and holder is None:  # no row yet, or held
                    LockRow.objects.using(self.using).bulk_create(
                        [
                            LockRow(
                                name=self.name,
                                token=token,
                                fencing_token=self.fencing_floor + 1,
                                expires_at=expires_at,
                            )
                        ],
                        ignore_conflicts=True,
                    )
                fencing_token: int | None = (
                    self._rows().filter(token=token).values_list("fencing_token", flat=True).first()
                )
        except DatabaseError as exc:
            raise LockError(f"lock {self.name!r}: database error: {exc}") from exc
        return fencing_token

    def _update_if_held(self, token: str, changes: Callable[[datetime], dict[str, Any]]) -> bool:
        """One conditional UPDATE: apply ``changes(now)`` if ``token`` holds an unexpired lease."""
        from django.db import DatabaseError

        self._outside_transaction()
        now = self.clock.now()
        try:
            held = self._rows().filter(token=token, expires_at__gt=now)
            return bool(held.update(**changes(now)))
        except DatabaseError as exc:
            raise LockError(f"lock {self.name!r}: database error: {exc}") from exc

    def _extend_token(self, token: str, ttl: float) -> bool:
        return self._update_if_held(token, lambda now: {"expires_at": now + timedelta(seconds=ttl)})

    def _hand_token(self, token: str, heir: str, ttl: float) -> bool:
        return self._update_if_held(
            token, lambda now: {"token": heir, "expires_at": now + timedelta(seconds=ttl)}
        )

    def _release_token(self, token: str) -> bool:
        # The row stays (with an empty token) so the fencing counter keeps counting.
        return self._update_if_held(token, lambda now: {"token": ""})

    def _thread_done(self) -> None:
        from django.db import connections

        connections[self.using].close()
