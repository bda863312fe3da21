"""User-facing errors: the CLI prints the message on one line and exits 2 (never a traceback)."""


class UsageError(Exception):
    """Bad arguments or bad input (unreadable file, unreachable source, invalid scenario)."""
