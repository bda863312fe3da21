"""Configuration: TOML file < environment (``KVTOP_*``) < command-line flags.

The file lives at ``$XDG_CONFIG_HOME/kvtop/config.toml`` (default ``~/.config/kvtop/config.toml``)
unless ``--config FILE`` names another. Every key is documented in the README ("Configuration").
Bad values anywhere are a one-line ``UsageError`` (exit 2), never a traceback.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtop.errors import UsageError, did_you_mean
from kvtop.model import jsonio

# key -> (type, environment variable). "urls" is a list; the rest are scalars.
KEYS: dict[str, tuple[str, str]] = {
    "url": ("urls", "KVTOP_URL"),  # engine URL(s); env: comma-separated
    "interval": ("seconds", "KVTOP_INTERVAL"),  # poll interval
    "duration": ("seconds", "KVTOP_DURATION"),  # snapshot sampling duration
    "timeout": ("seconds", "KVTOP_TIMEOUT"),  # per-scrape HTTP timeout
    "token": ("str", "KVTOP_TOKEN"),  # bearer token for /metrics
    "token_file": ("str", "KVTOP_TOKEN_FILE"),  # file holding the bearer token (kept out of `ps`)
    "adapter": ("str", "KVTOP_ADAPTER"),  # force an engine adapter (skip auto-detection)
    "itl_target_ms": ("ms", "KVTOP_ITL_TARGET_MS"),  # inter-token latency target
    "theme": ("str", "KVTOP_THEME"),  # console colour theme
    "format": ("str", "KVTOP_FORMAT"),  # snapshot output format: text or json
    "gpu": ("bool", "KVTOP_GPU"),  # read the GPU through NVML
    "host": ("bool", "KVTOP_HOST"),  # read host memory / pinned-memory signals
    "witness": ("str", "KVTOP_WITNESS"),  # the engine's witness file (kvtop.witness)
    # reaching a Prometheus API behind a gateway (--prometheus; its bearer token is token / token_file)
    "prometheus_user": ("str", "KVTOP_PROMETHEUS_USER"),  # basic-auth user
    "prometheus_password": ("str", "KVTOP_PROMETHEUS_PASSWORD"),  # basic-auth password (prefer the file)
    "prometheus_password_file": ("str", "KVTOP_PROMETHEUS_PASSWORD_FILE"),  # file holding that password
    "prometheus_ca_file": ("str", "KVTOP_PROMETHEUS_CA_FILE"),  # PEM CA bundle for its TLS certificate
    "prometheus_headers": ("list", "KVTOP_PROMETHEUS_HEADERS"),  # "Name: value" each; env: comma-separated
}

# Keys one command reads itself (not flags): known, so they draw no "unknown key" warning.
OTHER_KEYS: frozenset[str] = frozenset({"probe_ports"})  # the console's discovery ports (commands/tui.py)

_SECRET = frozenset({"token", "prometheus_password"})
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _shown(value: Any) -> str:
    """A wrong value as the error shows it: its repr, cut short (a config value may be megabytes)."""
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


def default_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "kvtop" / "config.toml"


def parse_seconds(value: Any, what: str) -> float:
    """Seconds from a number or a string like ``30``, ``30s``, ``500ms``, ``2m``."""
    if isinstance(value, bool):
        raise UsageError(f"{what} must be a number of seconds, not {_shown(value)}")
    if isinstance(value, (int, float)):
        try:
            v = float(value)
        except OverflowError:  # an integer past a double's range
            raise UsageError(f"{what} must be a finite number of seconds") from None
    elif isinstance(value, str):
        s = value.strip().lower()
        mult = 1.0
        for suffix, m in (("ms", 1e-3), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
            if s.endswith(suffix):
                s, mult = s[: -len(suffix)].strip(), m
                break
        try:
            v = float(s) * mult
        except (ValueError, OverflowError):
            raise UsageError(f"{what} must be a number of seconds (e.g. 10, 10s, 500ms, 2m), not {_shown(value)}") from None
    else:
        raise UsageError(f"{what} must be a number of seconds, not {_shown(value)}")
    if not (v == v) or v in (float("inf"), float("-inf")):
        raise UsageError(f"{what} must be a finite number of seconds, not {_shown(value)}")
    return v


def _coerce(key: str, value: Any, origin: str) -> Any:
    kind = KEYS[key][0]
    what = f"{key} ({origin})"
    if kind in ("urls", "list"):
        if isinstance(value, str):
            urls = [u.strip() for u in value.split(",") if u.strip()]
        elif isinstance(value, list) and all(isinstance(u, str) for u in value):
            urls = [u.strip() for u in value if u.strip()]
        else:
            raise UsageError(f"{what} must be " + ("a URL or a list of URLs" if kind == "urls" else "a list of strings"))
        return urls
    if kind == "seconds":
        return parse_seconds(value, what)
    if kind == "ms":
        if isinstance(value, bool):
            raise UsageError(f"{what} must be a number of milliseconds")
        try:
            v = float(value)
        except (TypeError, ValueError, OverflowError):
            raise UsageError(f"{what} must be a number of milliseconds, not {_shown(value)}") from None
        if not v > 0 or v == math.inf:
            raise UsageError(f"{what} must be positive and finite, not {_shown(value)}")
        return v
    if kind == "bool":
        if isinstance(value, bool):
            return value
        s = str(value).strip().lower()
        if s in _TRUE:
            return True
        if s in _FALSE:
            return False
        raise UsageError(f"{what} must be true or false, not {_shown(value)}")
    if not isinstance(value, str):
        # a secret's value is never echoed, even a wrong-typed one
        shown = type(value).__name__ if key in _SECRET else repr(value)
        raise UsageError(f"{what} must be a string, not {shown}")
    return value


def load_config(path: str | None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Config from the TOML file (``path`` or the XDG default) overlaid with ``KVTOP_*`` variables.

    A missing default file is fine (empty config); a missing file named explicitly is an error.
    An unknown key is kept but warned about on stderr, with the closest valid name (a typo would
    otherwise be ignored without a word).
    """
    env = os.environ if env is None else env
    explicit = path is not None
    p = Path(path) if path is not None else default_path()
    out: dict[str, Any] = {}
    data: dict[str, Any] = {}
    try:
        data = jsonio.read_toml(p, "config file", UsageError)
    except FileNotFoundError:
        if explicit:
            raise UsageError(f"config file not found: {p}") from None
    for k, v in data.items():
        out[k] = _coerce(k, v, str(p)) if k in KEYS else v
        if k not in KEYS and k not in OTHER_KEYS:
            sys.stderr.write(f"kvtop: warning: {p}: unknown key {_shown(k)}{did_you_mean(k, [*KEYS, *OTHER_KEYS])}\n")
    for key, (_, var) in KEYS.items():
        raw = env.get(var)
        if raw is not None and raw.strip() != "":
            out[key] = _coerce(key, raw, var)
    return out


def resolve(args: Any, config: Mapping[str, Any], key: str, default: Any = None, attr: str | None = None) -> Any:
    """Flag value if the flag was given (not None), else the config/env value, else ``default``.

    ``attr`` is the argparse attribute when it differs from the config key.
    """
    v = getattr(args, attr or key, None) if args is not None else None
    if v is not None:
        return v
    v = config.get(key)
    return default if v is None else v


TOKEN_FILE_MAX_BYTES = 64 << 10


def resolve_token(args: Any, config: Mapping[str, Any]) -> str | None:
    """The bearer token: ``--token`` > ``--token-file`` > ``KVTOP_TOKEN``/``token`` >
    ``KVTOP_TOKEN_FILE``/``token_file``. A file holds the token alone (surrounding whitespace is
    ignored); errors name the file, never its content."""
    flag = getattr(args, "token", None) if args is not None else None
    if flag is not None:
        return str(flag)
    path = getattr(args, "token_file", None) if args is not None else None
    if path is None:
        if config.get("token") is not None:
            return str(config["token"])
        path = config.get("token_file")
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(TOKEN_FILE_MAX_BYTES + 1)
    except (OSError, ValueError, TypeError) as e:  # ValueError: a NUL in the path; TypeError: not a path
        raise UsageError(f"cannot read token file {_shown(path)}: {getattr(e, 'strerror', None) or e}") from None
    if len(raw) > TOKEN_FILE_MAX_BYTES:
        raise UsageError(f"token file {path} is larger than {TOKEN_FILE_MAX_BYTES // 1024} KiB: not a token")
    try:
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise UsageError(f"token file {path} is not UTF-8 text") from None
    if not token or any(c in token for c in "\r\n") or not token.isprintable():
        raise UsageError(f"token file {path} must hold one token on one line")
    return token


def add_token_options(p: Any) -> None:
    """``--token`` / ``--token-file`` for commands that scrape engines."""
    p.add_argument("--token", default=None,
                   help="bearer token sent to /metrics (visible in the process list: prefer --token-file or "
                        "KVTOP_TOKEN)")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="read the bearer token for /metrics from FILE (also KVTOP_TOKEN_FILE / token_file)")


_HOST = re.compile(r"[A-Za-z0-9._~:-]+")  # a name, IPv4, or IPv6 without its brackets (as httpx gives it)


def http_url(url: str, flag: str = "URL") -> str:
    """``url`` as given (``host:port`` gets ``http://``), checked the way a connection will read it:
    http(s), a host, a port 1-65535; else a one-line UsageError naming ``flag`` (a malformed URL was a
    traceback from deep in the HTTP client, a port over 65535 an error about a TaskGroup)."""
    import httpx

    from kvtop.errors import UsageError

    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    try:
        parsed = httpx.URL(text)
    except (httpx.InvalidURL, ValueError, TypeError) as e:
        raise UsageError(f"{flag} {url!r} is not a valid URL: {e}") from None
    if parsed.scheme not in ("http", "https"):
        raise UsageError(f"{flag} takes only http:// and https:// URLs, not {url!r}")
    if not parsed.host or not _HOST.fullmatch(parsed.host):
        raise UsageError(f"{flag} {url!r} names no valid host")
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        raise UsageError(f"{flag} {url!r}: port {parsed.port} is outside 1-65535")
    return text


def engine_bases(urls: list[str]) -> list[str]:
    """Base URLs of the engines the user named; one-line UsageError for anything else."""
    from kvtop.errors import UsageError
    from kvtop.sources.scrape import split_url

    bases = []
    for u in urls:
        http_url(u, "--url")
        try:
            base, _ = split_url(u)
        except Exception:
            raise UsageError(f"not a valid URL: {u!r}") from None
        bases.append(base)
    return bases
