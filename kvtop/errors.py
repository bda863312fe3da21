"""User-facing errors: the CLI prints the message on one line (never a traceback) and exits with
the error's code, so a script can tell a wrong command line from a run that could not be done."""

EXIT_OK = 0
EXIT_FAILURE = 1  # the run could not do its job: engine unreachable, capture refused, port taken
EXIT_USAGE = 2  # the command line or an input file is wrong: fix it and run again


class UsageError(Exception):
    """Bad arguments or bad input (unknown flag, unreadable file, invalid scenario): exit 2."""


class RunFailure(Exception):
    """The command line was fine but the run failed (an engine or Prometheus that does not answer,
    a capture the host refuses, a port already taken): exit 1."""
