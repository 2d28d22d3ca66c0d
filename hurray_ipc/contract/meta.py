"""A handoff's array metadata (``meta``, docs/spec/ipc-protocol.md §4.5): what it may say and how
it must agree with the buffer's size. The broker checks it on HANDOFF; the consumer checks it again
before it builds any view on the bytes; the producer builds it (interop/source.py)."""

from __future__ import annotations

import re
from typing import Any

from ..errors import ProtocolError

__all__ = ["DL_DTYPE_BITS", "MAX_NDIM", "check_meta"]

# typestr of a meta: byte order, kind, item size (NumPy array-interface form), e.g. "<f4", "|u1".
# No 'U' (numpy's unicode): its typestr counts characters (<U1 is 4 bytes), not the item size in bytes.
_TYPESTR = re.compile(r"^[<>|=][biufcmMVS]([1-9][0-9]{0,3})$")
MAX_NDIM = 32
# meta.dl_dtype: DLPack codes with no typestr kind, each with its one bit width (bfloat16; float8).
DL_DTYPE_BITS = {4: 16, **{code: 8 for code in range(7, 15)}}


def check_meta(meta: Any, size: int) -> None:
    """Check a handoff's ``meta`` ({"shape": [...], "typestr": "<f4"}, or absent: raw bytes)
    against the buffer's ``size``: prod(shape) * itemsize == size. The broker checks it on
    HANDOFF and the consumer again before building a view (spec §4.5)."""
    if meta is None:
        return
    if not isinstance(meta, dict):
        raise ProtocolError("bad_header", f"meta must be an object, got {type(meta).__name__}", field="meta")
    shape, typestr = meta.get("shape"), meta.get("typestr")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**63 for n in shape):
        raise ProtocolError("bad_header", f"meta.shape must be a list of at most {MAX_NDIM} non-negative integers, "
                            f"got {str(shape)[:64]}", field="meta.shape")
    m = _TYPESTR.match(typestr) if isinstance(typestr, str) else None
    if m is None:
        raise ProtocolError("bad_header", f"meta.typestr {str(typestr)[:32]!r} is not a typestr such as '<f4'",
                            field="meta.typestr")
    dl_dtype = meta.get("dl_dtype")
    if dl_dtype is not None and not (
            isinstance(dl_dtype, list) and len(dl_dtype) == 3 and all(type(x) is int for x in dl_dtype)
            and DL_DTYPE_BITS.get(dl_dtype[0]) == dl_dtype[1] and dl_dtype[2] == 1
            and typestr == f"|V{dl_dtype[1] // 8}"):
        raise ProtocolError("bad_header", f"meta.dl_dtype {str(dl_dtype)[:48]} is not [code, bits, 1] of a DLPack "
                            f"dtype without a typestr (codes 4, 7-14) beside typestr '|V<bits/8>'",
                            field="meta.dl_dtype", value=str(dl_dtype)[:48])
    if "readonly" in meta and not isinstance(meta["readonly"], bool):
        raise ProtocolError("bad_header", "meta.readonly must be a boolean", field="meta.readonly")
    count = 1
    for n in shape:
        count *= n
    if count * int(m.group(1)) != size:
        raise ProtocolError("payload_mismatch", f"meta shape {shape} of {typestr} is {count * int(m.group(1))} bytes, "
                            f"the buffer is {size}", field="meta", value=f"{shape} {typestr}")
