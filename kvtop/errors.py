"""User-facing errors: the CLI prints the message on one line (never a traceback) and exits with
the error's code, so a script can tell a wrong command line from a run that could not be done."""

import difflib
from collections.abc import Iterable

EXIT_OK = 0
EXIT_FAILURE = 1  # the run could not do its job: engine unreachable, capture refused, port taken
EXIT_USAGE = 2  # the command line or an input file is wrong: fix it and run again


class UsageError(Exception):
    """Bad arguments or bad input (unknown flag, unreadable file, invalid scenario): exit 2."""


class RunFailure(Exception):
    """The command line was fine but the run failed (an engine or Prometheus that does not answer,
    a capture the host refuses, a port already taken): exit 1."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``; did you mean 'X'?`` for the closest of ``choices`` (difflib), or "" when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""
