"""One strict validator for the fields of received messages, whatever the protocol or verb.

Strict means: nothing is coerced, JSON ``true`` is no integer (Python says it is), strings and
integers have bounds, an object is a JSON object. A fault raises :class:`FieldError`, which names
the field by its dotted path into the message (``endpoint.device.ordinal``, ``route.links.2.peer``)
and keeps the value found, so that the refusal can show both (``docs/spec/ipc-protocol.md`` §2,
``field`` and ``value``). Each protocol turns a FieldError into its own refusal: the broker into
ERROR ``bad_header``, the interchange into its REJECT.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

__all__ = ["ABSENT", "FieldError", "check", "consumer_label", "is_label", "obj", "one_of", "shown", "take"]

ABSENT: Any = object()  # the value of a field the message does not have


def consumer_label(rid: bytes) -> str:
    """The name other clients know a client by (GRANT's ``consumer_id``, CAPS, UNMAP; spec §1):
    16 lowercase hex digits of a hash of its routing id. Stable across broker restarts, so a
    producer can name the consumer it handed a buffer to; not usable as a routing id."""
    return hashlib.sha256(b"hurray-consumer\0" + rid).hexdigest()[:16]


def is_label(v: Any) -> bool:
    """``v`` is a label as :func:`consumer_label` makes them."""
    return isinstance(v, str) and len(v) == 16 and all(c in "0123456789abcdef" for c in v)


class FieldError(ValueError):
    """Field ``path`` of a received message is absent, of the wrong type or out of bounds:
    ``why`` says which rule it breaks, ``value`` is what the message holds there (``ABSENT``)."""

    def __init__(self, path: str, why: str, value: Any = ABSENT):
        super().__init__(f"{path} {why}")
        self.path = path
        self.why = why
        self.value = value


Kinds = type | tuple[type, ...]


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def check(value: Any, path: str, kinds: Kinds, *, lo: int | None = None, hi: int | None = None,
          max_len: int | None = None, min_len: int = 0) -> Any:
    """``value`` itself if it is one of ``kinds`` (strictly) and within the bounds: ``lo``..``hi``
    for an integer, ``min_len``..``max_len`` items or characters for a string or list;
    FieldError naming ``path`` otherwise."""
    kinds_t = kinds if isinstance(kinds, tuple) else (kinds,)
    if (isinstance(value, bool) and bool not in kinds_t) or not isinstance(value, kinds_t):
        raise FieldError(path, f"must be {_names(kinds_t)}, got {str(value)[:32]!r}", value)
    if isinstance(value, str | list) and (len(value) < min_len or (max_len is not None and len(value) > max_len)):
        unit = "characters" if isinstance(value, str) else "items"
        bound = (f"at most {max_len}" if min_len == 0 else f"exactly {min_len}" if min_len == max_len
                 else f"{min_len}-{max_len}")
        raise FieldError(path, f"must have {bound} {unit}, got {len(value)}", value)
    if (isinstance(value, int) and not isinstance(value, bool)
            and ((lo is not None and value < lo) or (hi is not None and value > hi))):
        raise FieldError(path, f"must be in {lo}..{hi}, got {value}", value)
    return value


def take(d: Mapping[str, Any], path: str, kinds: Kinds, default: Any = ABSENT, *, lo: int | None = None,
         hi: int | None = None, max_len: int | None = None, min_len: int = 0) -> Any:
    """Field ``path`` (its last part is the key in ``d``) checked as :func:`check` does; ``default``
    when ``d`` lacks it, or FieldError "is missing" when no default is given. A present null is a
    value like any other: it passes only where ``kinds`` has ``type(None)``."""
    name = path.rsplit(".", 1)[-1]
    if name not in d:
        if default is ABSENT:
            raise FieldError(path, "is missing")
        return default
    return check(d[name], path, kinds, lo=lo, hi=hi, max_len=max_len, min_len=min_len)


def one_of(value: Any, path: str, choices: tuple[Any, ...]) -> Any:
    """``value`` if it is one of ``choices`` (of the same type: JSON true is not 1); FieldError
    naming ``path`` otherwise."""
    if not any(type(value) is type(c) and value == c for c in choices):
        raise FieldError(path, f"must be one of {list(choices)}, got {str(value)[:32]!r}", value)
    return value


def obj(value: Any, path: str) -> dict[str, Any]:
    """``value`` if it is a JSON object; FieldError naming ``path`` otherwise."""
    if not isinstance(value, dict):
        raise FieldError(path, f"must be an object, got {type(value).__name__}", value)
    return value


_JSON_TYPE = {dict: "object", list: "array", bool: "boolean", type(None): "null"}


def shown(header: Mapping[str, Any], path: str) -> Any:
    """The value a refusal shows for field ``path`` (spec §2): the message's own value at the dotted
    path, a number or a string cut to 64 characters, or the JSON type name of an object, array,
    boolean or null; None (JSON null) when the message has no such field."""
    v: Any = header
    for part in path.split("."):
        if not isinstance(v, Mapping) or part not in v:
            return None
        v = v[part]
    if isinstance(v, bool) or v is None:
        return _JSON_TYPE[type(v)]
    if isinstance(v, int | float):
        return v
    if isinstance(v, str):
        return v[:64]
    return _JSON_TYPE.get(type(v), type(v).__name__)
