"""Command-line entry point.

Each sub-command lives in ``kvtop/commands/<name>.py`` and exposes ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``. Command modules import only argparse-level
things at import time; heavy work (and Textual, for the console) is imported inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import re
import sys
from types import ModuleType
from typing import NoReturn

import kvtop.commands
from kvtop import __version__
from kvtop.errors import EXIT_FAILURE, EXIT_USAGE, RunFailure, UsageError, did_you_mean
from kvtop.log import FORMATS, LEVELS, level_from, setup


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse prints usage too)
        m = re.search(r"invalid choice: '?([^'\s]*)'? \(choose from (.*)\)", message)
        if m:  # `kvtop analyze --format jsn`: name the value that was meant
            message += did_you_mean(m.group(1), re.findall(r"'?([^',\s]+)'?", m.group(2)))
        sys.stderr.write(f"kvtop: error: {message}\n")
        raise SystemExit(EXIT_USAGE)

    def options(self) -> list[str]:
        """Every option string this parser takes (for suggestions)."""
        return [o for a in self._actions for o in a.option_strings]


def _commands() -> list[ModuleType]:
    pkg = kvtop.commands
    mods = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mods.append(importlib.import_module(f"kvtop.commands.{info.name}"))
    return sorted(mods, key=lambda m: getattr(m, "ORDER", 50))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kvtop",
        description="Console for GPU hosts serving LLMs: KV-cache pressure, preemptions, token gaps, verdicts.",
        epilog="exit status: 0 done; 1 the run failed (engine unreachable, capture refused, port taken); "
               "2 usage (bad option or input file). Shell completion: kvtop completion bash|zsh|fish.",
    )
    p.add_argument("--version", action="version", version=f"kvtop {__version__}")
    p.add_argument("--config", metavar="FILE", help="config file (default: $XDG_CONFIG_HOME/kvtop/config.toml)")
    p.add_argument("--plugin", metavar="PATH", action="append", default=[],
                   help="load an engine adapter from a .py file; the file is EXECUTED as Python with your "
                        "rights (even when it then defines no adapter): pass only files you trust")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="more detail on stderr (-vv: debug); the agent logs info by default")
    p.add_argument("-q", "--quiet", action="store_true", help="errors only on stderr")
    p.add_argument("--log-level", choices=LEVELS, default=None, help="log level (overrides -v/-q)")
    p.add_argument("--log-format", choices=FORMATS, default="text",
                   help="text (default) or json: one JSON object per line (for log pipelines; mostly the agent)")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    for mod in _commands():
        sp = sub.add_parser(mod.NAME, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP))
        mod.add_arguments(sp)
        sp.set_defaults(_run=mod.run)
    return p


GLOBAL_OPTIONS = ("--config", "--plugin", "--log-level", "--log-format")  # each takes a value
# -v/-q take none; `--quiet` is not moved: `kvtop proxy --quiet` is the proxy's own option
GLOBAL_FLAGS = ("-v", "-vv", "-vvv", "--verbose", "-q")


def _hoist_globals(raw: list[str]) -> list[str]:
    """The global options anywhere on the line (`kvtop snapshot --config F -v`): moved in front of
    the sub-command, where argparse reads them. Nothing after `--` moves."""
    front: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(raw):
        t = raw[i]
        if t == "--":
            rest.extend(raw[i:])
            break
        if t in GLOBAL_OPTIONS and i + 1 < len(raw):
            front += raw[i:i + 2]
            i += 2
            continue
        if t in GLOBAL_FLAGS or t.startswith(tuple(f"{o}=" for o in GLOBAL_OPTIONS)):
            front.append(t)
        else:
            rest.append(t)
        i += 1
    return front + rest


def _route_bare(raw: list[str]) -> list[str]:
    """`kvtop [--config F] [--plugin P] [console options]` means `kvtop ... tui [console options]`:
    insert the sub-command after the global options when no sub-command is named. A bare word where
    the sub-command goes is a mistyped one (`kvtop snapsht`): one line, with the closest name."""
    names = [m.NAME for m in _commands()]
    if "tui" not in names or any(t in names for t in raw) or any(t in ("-h", "--help", "--version") for t in raw):
        return raw
    i = 0
    while i < len(raw):
        if raw[i] in GLOBAL_OPTIONS:
            i += 2
        elif raw[i] in (*GLOBAL_FLAGS, "--quiet") or raw[i].startswith(tuple(f"{o}=" for o in GLOBAL_OPTIONS)):
            i += 1
        else:
            break
    if i < len(raw) and not raw[i].startswith("-"):
        raise UsageError(f"unknown command '{raw[i]}'{did_you_mean(raw[i], names)} "
                         f"(commands: {', '.join(sorted(names))})")
    return [*raw[:i], "tui", *raw[i:]]


def _parse(parser: argparse.ArgumentParser, raw: list[str]) -> argparse.Namespace:
    """parse_args, with "did you mean" for an unknown option of the sub-command (`--duraton`)."""
    args, extra = parser.parse_known_args(raw)
    if extra:
        sub = _subparser(parser, getattr(args, "command", None))
        known = [*(sub.options() if isinstance(sub, _Parser) else []),
                 *(parser.options() if isinstance(parser, _Parser) else [])]
        flag = next((t.split("=", 1)[0] for t in extra if t.startswith("--")), None)
        hint = did_you_mean(flag, known) if flag else ""
        parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args


def _subparser(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser | None:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction) and name in a.choices:
            sub: argparse.ArgumentParser = a.choices[name]
            return sub
    return None


def _error(message: str, log_format: str) -> None:
    """The one error line: text, or with --log-format json a JSON line like every other log line."""
    if log_format == "json":
        logging.getLogger("kvtop").error(message, extra={"fields": {"event": "error"}})
    else:
        sys.stderr.write(f"kvtop: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C while the parser is built (every command module is imported then): no traceback
        return 130


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = _parse(parser, _route_bare(_hoist_globals(list(argv if argv is not None else sys.argv[1:]))))
    except UsageError as e:
        sys.stderr.write(f"kvtop: error: {e}\n")
        return EXIT_USAGE
    setup(level_from(args.verbose, args.quiet, args.log_level,
                     default="info" if getattr(args, "command", None) == "agent" else "warning"), args.log_format)
    try:
        config = getattr(args, "config", None)
        if config is not None and not os.path.exists(config):
            # every command, also those that read no setting of it: a named file that is not there is a typo
            raise UsageError(f"config file not found: {config}")
        if args.plugin:
            # the adapter registry (entry points) only when --plugin is given: start-up time
            from kvtop.plugin import PluginError, load_plugin_file

            try:
                for path in args.plugin:
                    load_plugin_file(path)
            except PluginError as e:
                raise UsageError(str(e)) from None
        args._parser = parser  # `kvtop completion` generates its script from this very parser
        run = getattr(args, "_run", None)
        if run is None:
            # bare `kvtop`: the console (commands/tui.py decides how to find engines)
            if "tui" in {m.NAME for m in _commands()}:
                args = _parse(parser, ["tui", *_hoist_globals(list(argv if argv is not None else sys.argv[1:]))])
                run = args._run
            else:
                parser.print_help()
                return 0
        return int(run(args) or 0)
    except UsageError as e:
        _error(str(e), args.log_format)
        return EXIT_USAGE
    except RunFailure as e:
        _error(str(e), args.log_format)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `kvtop analyze T | head -1`: the reader left. Point stdout at /dev/null so the interpreter's
        # final flush stays quiet too, and exit like a process killed by SIGPIPE.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
