"""Claiming a wave in a process of its own: while a beat publishes one full batch, the next
is claimed by a helper process rather than a thread (what it buys: docs/explanation/performance.md,
"The mechanisms, and what each buys").

A beat is one Python process, and in a wave its claiming and publishing threads hold Python's
lock between them 80 to 85% of the time: adding threads adds nothing. The claim needs only the
database, so a beat that meets a full batch (500 tasks due at once) starts
one helper process (``multiprocessing``'s *spawn*: a fresh interpreter, nothing inherited
but the arguments), which sets Django up with the beat's database and ``DRIFTSAFE`` (and
``DRIFTSAFE_INTERNALS``) settings and then claims, as the beat's node, each batch the beat
asks for; the beat publishes the batches it gets back. Until the helper is ready, and after it
is lost, the beat claims ahead in a thread as before; a lost helper is replaced at the first
wave :data:`RESTART_SECONDS` later (twice that after a second loss, and so on).

What a claim commits is the beat's: if the helper or the beat dies between a claim and its
publish, the runs stay ``claimed`` and a beat's outbox publishes them once, as for a beat
that dies between its own claim and publish. The helper's log records go back with each
result and are logged by the beat. It ends when the beat asks (the beat stops, or the helper
has had nothing to claim for :data:`IDLE_SECONDS`: the next wave starts another), when the
beat's end of the pipe closes (the beat died), and with the beat (a daemon process); it
ignores the terminal's SIGINT and SIGTERM, which the beat handles for both. A beat whose
machine cannot spare a core (:func:`spare_cores`) starts none.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from celery_driftsafe.claim.helper_main import Request, configured_settings, serve
from celery_driftsafe.claim.usable_cpus import usable_cores

if TYPE_CHECKING:  # nothing Django-bound at import
    from celery_driftsafe.claim.claimers import ClaimResult

logger = logging.getLogger("celery_driftsafe.scheduler")

#: Seconds a stopping beat waits for its helper to end before it is terminated.
STOP_SECONDS = 5.0
#: A helper that has claimed nothing this long is stopped (the next wave starts another):
#: waves a minute apart keep one, a wave an hour does not hold its memory in between.
IDLE_SECONDS = 300.0
#: A lost helper (killed, say by the kernel's OOM killer) is replaced at the first wave this
#: long after the loss, twice as long after each further loss, at most RESTART_MAX_SECONDS.
RESTART_SECONDS = 60.0
RESTART_MAX_SECONDS = 3600.0


class ClaimProcessLost(Exception):
    """The helper process ended, or could not be reached, while a batch was asked of it."""


class ClaimProcess:
    """One helper process claiming for node ``node_id`` on database ``using``."""

    def __init__(
        self, using: str, node_id: str, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self.using = using
        self.node_id = node_id
        self._monotonic = monotonic
        self._process: Any = None
        self._conn: Any = None
        self._ready = False
        self._busy = False
        #: Why the helper cannot be used (set once; the beat then claims in a thread).
        self.unavailable: str | None = None
        #: Batches claimed there (for tests and figures).
        self.claims = 0
        #: Helpers lost so far, and when (``monotonic``) the next may be started.
        self.losses = 0
        self._restart_at: float | None = None

    def start(self) -> None:
        """Start the helper (it gets ready in the background: see :attr:`ready`)."""
        if self._process is not None or self.unavailable is not None:
            return
        from django.conf import settings

        module = os.environ.get("DJANGO_SETTINGS_MODULE")  # the helper imports it, or else:
        configured = None if module else configured_settings(settings)
        try:
            config = pickle.dumps(
                (
                    self.using,
                    self.node_id,
                    dict(settings.DATABASES[self.using]),
                    getattr(settings, "DRIFTSAFE", {}),
                    getattr(settings, "DRIFTSAFE_INTERNALS", {}),
                    configured,
                    logging.getLogger("celery_driftsafe").getEffectiveLevel(),
                )
            )
        except Exception as exc:  # something in the settings cannot cross to a process
            self._give_up(f"its settings cannot be sent to a process: {exc!r}")
            return
        _spawnable_authkey()
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        process = context.Process(
            target=serve, args=(child, config), name="driftsafe-claim", daemon=True
        )
        try:
            process.start()
        except Exception as exc:
            self._conn.close()
            self._conn = None
            self._give_up(f"it could not be started: {exc!r}", lost=True)
            return
        finally:
            child.close()
        self._process = process
        logger.info(
            "a wave: starting a claim process (pid %s)",
            self._process.pid,
            extra={"action": "claim-process", "node": self.node_id},
        )

    @property
    def ready(self) -> bool:
        """Whether the helper has set itself up and waits for work (never blocks)."""
        if self._ready or self._conn is None or self.unavailable is not None:
            return self._ready and self.unavailable is None
        try:
            if self._conn.poll():
                message = self._conn.recv()
                if message == "ready":
                    self._ready = True
                else:
                    self._give_up(f"it could not set itself up: {message}")
            elif not self._process.is_alive():
                self._give_up(
                    f"it ended while setting itself up (exit code {self._exit_code()})", lost=True
                )
        except (EOFError, OSError) as exc:
            self._give_up(f"it ended while setting itself up: {exc!r}", lost=True)
        return self._ready and self.unavailable is None

    @property
    def running(self) -> bool:
        """Whether a helper was started and not stopped since."""
        return self._process is not None

    @property
    def started(self) -> bool:
        """Whether :meth:`start` was called (whatever came of it)."""
        return self._process is not None or self.unavailable is not None

    @property
    def busy(self) -> bool:
        """Whether a batch asked for is not yet taken."""
        return self._busy

    def submit(self, now: datetime, busy_since: datetime | None) -> None:
        """Ask for one batch claimed at ``now`` (an authority reading); :meth:`result` waits
        for it."""
        assert self.ready and not self._busy
        try:
            self._conn.send(Request(now, busy_since))
        except (OSError, ValueError) as exc:
            self._give_up(f"it could not be reached: {exc!r}", lost=True)
            raise ClaimProcessLost(self.unavailable) from exc
        self._busy = True

    def result(self) -> ClaimResult:
        """The batch asked for with :meth:`submit` (raises its claim's error, or
        :class:`ClaimProcessLost` when the helper ended meanwhile)."""
        assert self._busy
        self._busy = False
        try:
            kind, payload, records = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._give_up(f"it ended during a claim (exit code {self._exit_code()})", lost=True)
            raise ClaimProcessLost(self.unavailable) from exc
        for record in records:
            logging.getLogger(record.name).handle(record)
        if kind == "error":
            raise payload
        self.claims += 1
        return payload  # type: ignore[no-any-return]

    def stop(self, why: str = "the beat stops") -> None:
        """Ask the helper to end, and wait for it (terminated after :data:`STOP_SECONDS`);
        a later :meth:`start` starts another. A lost helper, ended when it was found lost, is
        only reaped."""
        process, self._process = self._process, None
        if process is None:
            return
        if self.unavailable is None:
            logger.info(
                "stopping the claim process (pid %s): %s; %d batches claimed there in all",
                process.pid,
                why,
                self.claims,
                extra={"action": "claim-process", "node": self.node_id},
            )
            try:
                if self._busy:
                    # a claim nobody took (the caller takes every batch first): what it
                    # committed stays claimed, and the outbox publishes it after the lease
                    self._conn.recv()
                self._conn.send(None)
            except (EOFError, OSError, ValueError):
                pass
        self._release(process)

    def _release(self, process: Any) -> None:
        """Wait for ``process`` to end (terminated after :data:`STOP_SECONDS`) and drop its
        pipe."""
        process.join(STOP_SECONDS)
        if process.is_alive():
            process.terminate()
            process.join(STOP_SECONDS)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._ready = self._busy = False

    def decline(self, why: str) -> None:
        """Do without the helper for this beat's life (the machine has no core to spare)."""
        if self.unavailable is None and self._process is None:
            self.unavailable = why
            logger.info(
                "no claim process: %s; this beat claims in a thread",
                why,
                extra={"action": "claim-process", "node": self.node_id},
            )

    def revive(self) -> bool:
        """Once the wait after a lost helper is over, forget it, so that the next wave starts
        another (:meth:`start`); whether it did."""
        if self._restart_at is None or self._busy or self._monotonic() < self._restart_at:
            return False
        self._restart_at = None
        process, self._process = self._process, None
        if process is not None:  # not reaped yet (stop() may have done it since the loss)
            self._release(process)
        self.unavailable = None
        return True

    def _give_up(self, why: str, *, lost: bool = False) -> None:
        """Do without the helper: for good, or, when it was ``lost``, until :meth:`revive`."""
        if self.unavailable is None:
            self.unavailable = why
            extra = {"action": "claim-process", "node": self.node_id}
            if lost:
                self.losses += 1
                wait = min(RESTART_SECONDS * 2 ** (self.losses - 1), RESTART_MAX_SECONDS)
                self._restart_at = self._monotonic() + wait
                logger.warning(
                    "the claim process was lost: %s; this beat claims in a thread, and a wave "
                    "%g s from now or later starts another",
                    why,
                    wait,
                    extra=extra,
                )
            else:
                logger.warning(
                    "the claim process is not used: %s; this beat claims in a thread",
                    why,
                    extra=extra,
                )
        if self._process is not None and self._process.is_alive():
            self._process.terminate()

    def _exit_code(self) -> Any:
        if self._process is None:
            return None
        self._process.join(0.5)
        return self._process.exitcode


def _spawnable_authkey() -> None:
    """Give this process's authentication key multiprocessing's own type. A process started by
    billiard (the beat of ``celery worker -B`` runs in one) carries billiard's type, which
    multiprocessing's *spawn* refuses to pickle: the helper could not be started there."""
    config: dict[str, Any] = getattr(multiprocessing.current_process(), "_config", {})
    plain: Any = multiprocessing.process.AuthenticationString  # type: ignore[attr-defined]
    key = config.get("authkey")
    if key is not None and not isinstance(key, plain):
        config["authkey"] = plain(bytes(key))


def spare_cores(beats_here: int, cores: float | None = None) -> str | None:
    """Why a beat should not start a claim process when ``beats_here`` live beats (itself
    included) run on its machine: each beat and each helper want a core of their own, so
    beats and helpers together must not outnumber the cores this process may run on
    (``cores``; by default :func:`~celery_driftsafe.claim.usable_cpus.usable_cores`). None: there is
    room."""
    if cores is None:
        cores = usable_cores()
    beats = max(beats_here, 1)
    if 2 * beats > cores:
        return (
            f"{beats} beat(s) and their helpers would outnumber the {cores:g} cores "
            "this beat may use"
        )
    return None
