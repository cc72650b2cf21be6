"""What a broker's answers to a publish mean: a refusal of one message (a negative publisher
confirm) or an outage (it cannot be reached), and kombu's pipelined publishing of a batch."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any


def refused(exc: BaseException) -> bool:
    """Whether the broker answered this one message with a refusal (a negative publisher
    confirm: the queue is full, a policy rejects it), which kombu reports as a recoverable
    connection error although the connection is fine."""
    seen: BaseException | None = exc
    while seen is not None:
        if type(seen).__name__ == "MessageNacked":
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def describe_error(exc: BaseException) -> str:
    text = str(exc) or "no detail given"
    if refused(exc) and "Nack" not in text:
        text = f"the broker answered with a negative acknowledgement (Nack); {text}"
    return f"{type(exc).__name__}: {text}"


def pipelined(producer: Any, messages: int) -> Any:
    """kombu's publish batch for ``messages`` messages (one pipelined write on Redis), or no
    batching where the producer or transport has none (they publish one by one)."""
    batch = getattr(producer, "batch", None)
    if batch is None or messages < 2:
        return nullcontext()
    # kombu counts broker commands, not messages, and writes early when it reaches the bound:
    # leave room (a message to a queue with priorities or an expiry is several commands).
    return batch(max_size=messages * 16)


def connection_errors(producer: Any) -> tuple[type[BaseException], ...]:
    """The exceptions that mean "the broker cannot be reached" (not "it refused this one")."""
    from kombu.exceptions import OperationalError

    connection = getattr(producer, "connection", None)
    errors = tuple(getattr(connection, "connection_errors", ()) or ())
    return (*errors, OperationalError, ConnectionError)
