"""Every error Hurray raises on purpose derives from :class:`HurrayError` (a leaf module: no imports).

Each one also derives from the builtin a numpy or torch user already catches, so ``except
ValueError`` keeps working for bad input and ``except HurrayError`` catches everything of ours:

==========================  ==================  ===================================================
class                       builtin             raised when
==========================  ==================  ===================================================
:class:`InvalidArgument`    ValueError          a value the caller gave is out of range or malformed
:class:`UnsupportedObject`  TypeError           an object (or dtype) Hurray cannot hand off or use
:class:`ExportRefused`      BufferError         a received buffer cannot be exported as asked
:class:`HurrayTimeout`      TimeoutError        a bounded wait ran out (nothing was lost: see below)
:class:`ClosedError`        RuntimeError        a call on a closed Producer or Consumer
:class:`EndOfStream`        EOFError            every producer of the channel ended and all was received
:class:`MissingDependency`  ImportError         an optional library a call needs is not installed
:class:`UnsafeEndpoint`     PermissionError     the socket directory is another user's, or open to them
:class:`BrokerUnavailable`  ConnectionError     the broker did not answer within the session's timeout, or shut down
:class:`RemoteError`        RuntimeError        the broker refused a message (``code``: one of ERROR_CODES)
:class:`ProducerGone`       RuntimeError        a handoff's producer died, or took it back from a fenced consumer
==========================  ==================  ===================================================

Other layers add their own, each a subclass too: ``HandleError`` (ValueError, format/),
``HandoffError`` (ValueError) and ``AlreadyReleasedError`` (RuntimeError, contract/),
``DeviceError`` (RuntimeError, devices/); :class:`ProtocolError` (ValueError) is here. All are
exported from :mod:`hurray_ipc`.

Messages name what was wrong, where (the call and argument) and the value, and where there is
one, the fix. A call that raises gives back everything it took (see client/DESIGN.md).
"""

from __future__ import annotations

import re
from typing import Any


class HurrayError(Exception):
    """Base class of every error Hurray raises on purpose."""


_NOTHING = object()


class _Located(HurrayError):
    """An error about one argument: ``where`` (e.g. ``"send(shape=)"``) and the ``value`` given,
    which the message shows (``got ...``) unless its text already does."""

    def __init__(self, message: str, *, where: str | None = None, value: Any = _NOTHING):
        self.where = where
        self.value = None if value is _NOTHING else value
        if value is not _NOTHING:
            shown = repr(value)
            if len(shown) > 80:
                shown = shown[:77] + "..."
            # As a word: 0 is not shown by "4096", nor 1 by "1.5"; a full stop after it ends a sentence.
            if not re.search(rf"(?<![\w.]){re.escape(shown)}(?!\w|\.\w)", message):
                message = f"{message} (got {shown})"
        super().__init__(f"{where}: {message}" if where else message)


def an(noun: str) -> str:
    """``noun`` with its indefinite article, for messages: 'an int', 'a list'."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


class InvalidArgument(_Located, ValueError):
    """A value given by the caller is out of range or malformed."""


class UnsupportedObject(_Located, TypeError):
    """An object (or a dtype) that Hurray cannot hand off or use as asked."""


class ExportRefused(_Located, BufferError):
    """A received buffer cannot be exported the way a consumer asked (DLPack, buffer protocol)."""


class HurrayTimeout(HurrayError, TimeoutError):
    """A wait with a timeout ran out. The call gave back what it took before raising."""


class ClosedError(HurrayError, RuntimeError):
    """The Producer or Consumer was closed (or its producer ended its stream) before this call."""


class UnsafeEndpoint(HurrayError, PermissionError):
    """The broker's socket directory could be swapped by another user (ipc-protocol.md §1): refused
    before anything connects or binds there."""


class MissingDependency(HurrayError, ImportError):
    """An optional library a call needs (torch, cupy) is not installed; the message says how to get it."""


class EndOfStream(HurrayError, EOFError):
    """Every producer of the channel ended its stream and every handoff sent before was received
    (ipc-protocol.md §4.9). A new producer may reopen the channel."""


class BrokerUnavailable(HurrayError, ConnectionError):
    """No reply from the broker within the session's timeout (or it announced shutdown). The
    message says whether the socket file exists, how long this call waited, how long the broker
    has been silent, and the command that starts one. The client keeps trying: once a broker
    answers it registers again by itself, with what it holds."""


class RemoteError(HurrayError, RuntimeError):
    """The broker refused a message: ``code`` (one of ERROR_CODES, below) and its explanation."""

    def __init__(self, code: str, message: str, header: dict[str, Any] | None = None):
        self.code = code
        self.header = header or {}
        super().__init__(f"broker refused: {code}: {message}")


class ProducerGone(HurrayError, RuntimeError):
    """The producer of this handoff died, or took it back from this consumer because it was
    fenced (silent past the broker's ``fence_ms`` while holding it, spec §5): the handoff is over."""


# Error codes an ERROR message carries (docs/spec/ipc-protocol.md §2): the broker's refusals.
ERROR_CODES = frozenset({
    "bad_frames",        # wrong frame count, or a payload frame of the wrong size
    "unknown_verb",
    "bad_header",        # not a JSON object / not the binary layout, or a field missing, of the wrong type or range
    "protocol_version",  # HELLO with a version this broker does not speak
    "not_registered",    # a message before HELLO (or after the broker restarted): send HELLO
    "wrong_role",        # e.g. a consumer sending READY
    "bad_handle",        # the 16-byte handle is invalid (HandleError reason in `reason`)
    "mode_not_valid",    # the declared sync_mode is not valid for this producer/consumer pair
    "payload_mismatch",  # payload frames do not match the declared sync_mode
    "unknown_grant",
    "unknown_token",
    "foreign_token",     # a release of a token delivered to another consumer
    "already_released",
    "consumer_gone",     # the consumer of a grant died before the handoff arrived
    "limit_exceeded",    # a per-client or broker-wide limit (clients, held deliveries): the message is refused
    "ended",             # READY or HANDOFF from a producer that ended its stream (END, §4.9)
    "not_authorized",    # a ROUTE without the broker's route key (§2.4)
    "internal",          # a broker bug cost this one message; the broker and every other client carry on
})


class ProtocolError(HurrayError, ValueError):
    """A message that violates the protocol. ``code`` is one of ERROR_CODES."""

    charge = True  # whether the broker's ERROR for it counts against the sender's message rate (spec §6a)

    def __init__(self, code: str, message: str, **extra: Any):
        assert code in ERROR_CODES, code
        self.code = code
        self.extra = extra  # more fields for the ERROR header, e.g. a HandleError's reason
        super().__init__(f"{code}: {message}")
