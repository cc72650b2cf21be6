"""A fast-path message's Redis envelope as JSON text, spliced from a shape made once per
skeleton (see docs/reference/settings.md, "The fast publish path").

kombu's Redis channel stores a message as one JSON document: the body (base64), its content
type and encoding, the headers and the properties. For a task whose messages share a
:class:`~celery_driftsafe.publish.message_parts.Skeleton`, everything in it but a dozen values is
the same
from message to message: encoding all of it again was a fifth of a beat's CPU in a catch-up.
So the document is built once per skeleton, route and set of custom header names, exactly as
:meth:`~celery_driftsafe.publish.redis_writer.RedisWriter.envelope` builds it (the channel's own
methods), with a marker in place of each value that varies; its JSON text is cut at the
markers; and each message is the pieces with its own values, each encoded by the same JSON
encoder, in between. The text is the one kombu would have stored, to the byte
(``tests/publish/test_fast_path.py`` compares them). A marker holds a random word drawn when the
process starts, so no task's data can be taken for one.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any

#: The varying values, in the order :func:`render` takes them (then the custom headers').
BODY, TASK_ID, REPLY_TO, ARGSREPR, KWARGSREPR, EXPIRES, EXPIRATION, DELIVERY_TAG = range(8)
#: How many of them there are: the custom headers' values come after.
FIXED = DELIVERY_TAG + 1


_WORD = secrets.token_hex(8)


def marker(index: int) -> str:
    """The stand-in for value ``index`` while a shape is made."""
    return f"\x00{_WORD}-{index}\x00"


#: A marker as kombu's JSON (``ensure_ascii``) writes it, with its quotes.
_MARKER_TEXT = re.compile(rf'"\\u0000{_WORD}-(\d+)\\u0000"')


@dataclass(frozen=True, slots=True)
class EnvelopeShape:
    """A document's JSON text cut at its varying values: ``pieces[0] value pieces[1] …``."""

    #: The Redis list the message goes to (the route's queue and the message's priority).
    key: str
    pieces: tuple[str, ...]
    #: For each gap between two pieces, which value fills it.
    slots: tuple[int, ...]


def make_shape(
    document: dict[str, Any], key: str, values: int, dumps: Callable[[Any], str]
) -> EnvelopeShape:
    """The shape of ``document``, built with :func:`marker` ``(i)`` in place of each of its
    ``values`` varying values."""
    parts = _MARKER_TEXT.split(dumps(document))
    slots = tuple(int(index) for index in parts[1::2])
    assert all(index < values for index in slots), slots
    return EnvelopeShape(key, tuple(parts[0::2]), slots)


def render(shape: EnvelopeShape, values: Sequence[str]) -> str:
    """The document's text with ``values`` (each already JSON text) in its gaps."""
    pieces = shape.pieces
    out = [pieces[0]]
    for i, slot in enumerate(shape.slots, start=1):
        out.append(values[slot])
        out.append(pieces[i])
    return "".join(out)


def run_text(
    shape: EnvelopeShape,
    encode: Callable[[Any], str],
    body: str,
    task_id: str,
    reply_to: str,
    argsrepr: str,
    kwargsrepr: str,
    expires: str | None,
    expiration: float | None,
    delivery_tag: str,
    headers: dict[str, Any],
) -> str:
    """One run's envelope text: its values, each as the JSON encoder ``encode`` writes it,
    in ``shape``'s gaps (``body`` is the body as the channel encodes it, ``expiration`` the
    message's time to live in seconds, ``headers`` its custom headers, in the order of the
    names the shape was made for)."""
    values = [
        json_text(body, encode),
        encode_basestring_ascii(task_id),
        json_text(reply_to, encode),
        encode_basestring_ascii(argsrepr),
        encode_basestring_ascii(kwargsrepr),
        json_text(expires, encode),
        f'"{int(expiration * 1000)}"' if expiration is not None else "null",
        f'"{delivery_tag}"',
    ]
    for value in headers.values():
        values.append(json_text(value, encode))
    return render(shape, values)


def json_text(value: Any, encode: Callable[[Any], str]) -> str:
    """``value`` as the JSON encoder ``encode`` writes it inside a document (a string or a
    whole number written directly, the same text the encoder gives them)."""
    kind = type(value)
    if kind is str:
        return encode_basestring_ascii(value)
    if kind is int:
        return int.__repr__(value)
    if value is None:
        return "null"
    return encode(value)
