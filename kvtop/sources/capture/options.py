"""``--capture [PORT]``: the option every command that observes live engines shares."""

from __future__ import annotations

import argparse

from kvtop.errors import UsageError

CAPTURE_HELP = ("observe the engine's HTTP traffic passively (Linux, root or CAP_NET_RAW): every request's "
                "token timeline without a proxy; PORT defaults to the engine URL's port")


def capture_port(text: str) -> int:
    """argparse type for ``--capture PORT``."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--capture takes a TCP port, not {text!r}") from None
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"--capture port must be 1-65535, not {port}")
    return port


def add_capture_argument(p: argparse.ArgumentParser) -> None:
    # const 0: "the port of the first --url", resolved once the URL is known
    p.add_argument("--capture", nargs="?", const=0, type=capture_port, default=None, metavar="PORT",
                   help=CAPTURE_HELP)


def resolve_capture_port(value: int | None, base_url: str | None) -> int | None:
    """The port to capture: the one given, else the engine URL's (explicit or the scheme's default)."""
    if value is None:
        return None
    if value:
        return value
    if not base_url:
        raise UsageError("--capture without a PORT needs the engine's --url")
    from yarl import URL  # every command's parser imports this module: yarl only when a port is needed

    u = URL(base_url)
    port = u.port
    if port is None:
        raise UsageError(f"cannot tell the port of {base_url}; give it: --capture PORT")
    return port

