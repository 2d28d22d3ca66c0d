"""Secrets the broker hands to its own user through owner-only files beside its socket.

Two: the metrics bearer token (``<socket>.metrics-token``, hurray_ipc/broker/metrics.py) and the route key
(``<socket>.route-key``): only a client that can read the key may announce a bridge route (ROUTE,
ipc-protocol.md §2.4), so clients of a ``--group`` broker cannot put a made-up bridge into CAPS
answers. Who can read the file is who the operating system says: the broker's uid (and its group
with ``group=True``); no protocol of ours decides it.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from pathlib import Path


def write_token(path: Path, group: bool = False) -> str:
    """A new random token, written to ``path`` (mode 0600, 0640 with ``group``) by replacing the
    file: a reader sees the old token or the new one, never a partial one."""
    token = secrets.token_hex(32)
    mode = 0o640 if group else 0o600
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")  # not guessable beforehand
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        try:
            os.fchmod(fd, mode)  # whatever the umask
            os.write(fd, token.encode() + b"\n")
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave a copy of the secret behind
        raise
    return token


def read_token(path: Path) -> str | None:
    """The token ``path`` holds, only when it is a regular file (not a link) of this uid, mode
    0600, holding one token (64 lowercase hex digits); else None. Raises OSError when it cannot be
    read at all (e.g. missing, or a link: O_NOFOLLOW)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block
    try:
        st = os.fstat(fd)  # the file opened, not whatever the name points to by now
        if not (stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o600):
            return None
        raw = os.read(fd, 130)  # a token and a newline, with room to see that there is more
    finally:
        os.close(fd)
    token = raw.decode("ascii", "replace").strip()
    return token if re.fullmatch(r"[0-9a-f]{64}", token) else None


def kept_token(path: Path) -> str:
    """The token ``path`` holds (:func:`read_token`): a restarted broker keeps its route key, so
    bridges in other processes that read it once go on announcing routes; otherwise a new one
    written there."""
    try:
        token = read_token(path)
    except OSError:
        token = None
    return token if token is not None else write_token(path)


def route_key_path(endpoint: str) -> Path | None:
    """Where the broker of ``endpoint`` keeps its route key: beside an ipc:// socket; None for
    other endpoints (only the broker's own bridges, given the key in memory, may ROUTE there)."""
    return Path(endpoint[len("ipc://"):] + ".route-key") if endpoint.startswith("ipc://") else None
