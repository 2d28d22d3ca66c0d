"""How the broker's log lines look: ``--log-format text`` (the default, for people) or ``json``.

Much of the broker logs a JSON object as the message (``log.info(json.dumps({"event": ...}))``),
some of it plain text (``log.exception("internal error ...")``). Both formatters take either shape:
a message that is a JSON object is an event and its fields; anything else is a plain message.

text: ``2026-12-04T06:35:54.123Z info  hello client=0376e6a0 role=consumer channel=x``: ISO-8601 UTC
time, level, event, then ``key=value`` pairs in the order they were logged. A value with spaces,
quotes, ``=`` or control characters (or an empty one) is written as a JSON string, so a line is
always one line and splits unambiguously; lists and objects are compact JSON. A 32-hex-digit
client id is shortened to its first 8 digits, as a person reads it (json keeps it whole).

json: one object per line, as before, with ``time`` (the same ISO-8601 UTC string) beside ``ts``
(epoch seconds): ``{"ts", "time", "level", "logger", "event", ...fields}``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from typing import Any

FORMATS = ("text", "json")
_PLAIN = re.compile(r'^[^\s"=\\\x00-\x1f\x7f]+$')  # written as is; anything else is quoted
_CLIENT_ID = re.compile(r"^[0-9a-f]{32}$")
_ROOT_LOGGER = "hurray.broker"  # text lines name any other logger (the bridges', NIXL's)


def iso_time(epoch: float) -> str:
    """``epoch`` to the millisecond as ISO-8601 UTC: 2026-12-04T06:35:54.123Z (rounded as the json
    format's ``ts`` is, so that the two always name the same millisecond)."""
    s, ms = divmod(round(epoch * 1000), 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(s)) + f".{ms:03d}Z"


def _body(record: logging.LogRecord) -> tuple[dict[str, Any], bool]:
    """(fields, is_event): the message's JSON object, or {"message": text}."""
    msg = record.getMessage()
    if msg.startswith("{"):
        try:
            body = json.loads(msg)
        except ValueError:
            body = None
        if isinstance(body, dict):
            return body, True
    return {"message": msg}, False


def text_value(key: str, value: Any) -> str:
    """One value of a text line (see the module doc)."""
    if isinstance(value, str):
        if key == "client" and _CLIENT_ID.match(value):
            return value[:8]
        return value if _PLAIN.match(value) else json.dumps(value)
    text = json.dumps(value, separators=(",", ":"), default=str)
    return text if _PLAIN.match(text) else json.dumps(text)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        body, is_event = _body(record)
        head = f"{iso_time(record.created)} {record.levelname.lower():<5} "
        if is_event:
            event = body.pop("event", None)
            words = [text_value("event", event) if isinstance(event, str) else "-"]
        else:
            words = [str(body.pop("message")).replace("\n", "\\n")]
        words += [f"{k}={text_value(k, v)}" for k, v in body.items()]
        if record.name != _ROOT_LOGGER:
            words.append(f"logger={record.name}")
        line = head + " ".join(words)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        body, _ = _body(record)
        out = {"ts": round(record.created * 1000) / 1000, "time": iso_time(record.created),
               "level": record.levelname.lower(),
               "logger": record.name, **body}
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def formatter(name: str) -> logging.Formatter:
    """The formatter ``--log-format name`` asks for."""
    if name not in FORMATS:
        raise ValueError(f"log format {name!r}: expected one of {', '.join(FORMATS)}")
    return TextFormatter() if name == "text" else JsonFormatter()


def open_log(path: str | os.PathLike[str]) -> int:
    """``path`` opened for appending, created owner-only (a broker log names clients and pids)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)


def configure(log_file: str | None, log_format: str, log_level: str) -> str | None:
    """Send this process's log to ``log_file`` (appended, created owner-only) or stderr, in
    ``log_format`` at ``log_level``: the broker's options, which its bridges are given too. Returns
    why the file cannot be opened, or None."""
    handler: logging.Handler
    if log_file:
        try:
            os.close(open_log(log_file))  # created owner-only, before logging opens it
        except OSError as e:
            return f"log file {log_file}: {e.strerror}"
        handler = logging.FileHandler(log_file, mode="a")
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format))
    logging.basicConfig(level=log_level.upper(), handlers=[handler])
    return None
