"""Logging for every command: stdlib ``logging`` under the ``kvtop`` logger, on stderr.

``-v``/``-q``/``--log-level`` set the level (default: warning; the agent, a daemon, info) and
``--log-format json`` writes one JSON object per line (for journald, Loki, Kubernetes log
pipelines). A record's structured fields go in ``extra={"fields": {...}}``: the text format shows
the message, the JSON format carries the fields too. Nothing private is logged (no prompt or
completion text, no request headers, no tokens; URLs are already redacted by the sources).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
ROOT = "kvtop"


class ServerLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server log for kvtop's HTTP ports (the proxy's, the agent's): one line per failed
    request, naming the exception's class only, never a traceback.

    aiohttp answers a request its parser refuses (a header over 8 KiB, a Content-Length that is not
    a number, control characters in an ``X-Request-Id``) with 400 and then logs the whole traceback,
    whose message quotes the offending bytes: an ``Authorization`` header, a cookie. That is the
    client's mistake and none of the log's business beyond one line; a handler's own error is one
    line too (its traceback at debug level)."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger(ROOT + ".http"), {})

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kw: Any) -> None:
        e = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        name = type(e).__name__ if e is not None else "error"
        if e is not None and type(e).__module__.startswith("aiohttp.http"):
            self.logger.info("refused a malformed request (%s)", name)
            return
        self.logger.error("error handling a request (%s)", name)
        self.logger.debug("the error's traceback", exc_info=exc_info)


class _Text(logging.Formatter):
    """``kvtop agent: warning: engine ... did not answer`` (info lines carry no level word)."""

    def format(self, record: logging.LogRecord) -> str:
        who = record.name.replace(".", " ") if record.name != ROOT else "kvtop"
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        return f"{who}: {level}{record.getMessage()}"


class _TextOnTerminal(_Text):
    """On a terminal, a log line first clears the progress line a long command may be drawing."""

    def format(self, record: logging.LogRecord) -> str:
        return "\r\x1b[K" + super().format(record)


class _Json(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            doc.update({k: v for k, v in fields.items() if k not in doc})
        return json.dumps(doc, default=str, allow_nan=False)


def level_from(verbose: int, quiet: bool, level: str | None, default: str = "warning") -> int:
    """The effective level: ``--log-level`` wins, then ``-q`` (errors only), then each ``-v`` one
    step more detail than ``default``."""
    if level is not None:
        return int(getattr(logging, level.upper()))
    if quiet:
        return logging.ERROR
    base = int(getattr(logging, default.upper()))
    return max(logging.DEBUG, base - 10 * verbose)


def setup(level: int, fmt: str = "text", stream: TextIO | None = None) -> logging.Logger:
    """Configure the ``kvtop`` logger once per process (a second call replaces the handler)."""
    log = logging.getLogger(ROOT)
    for h in list(log.handlers):
        log.removeHandler(h)
    out = stream or sys.stderr
    handler = logging.StreamHandler(out)
    handler.setFormatter(_Json() if fmt == "json" else _TextOnTerminal() if _isatty(out) else _Text())
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False  # a library user's root handlers do not print kvtop's lines twice
    return log


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
