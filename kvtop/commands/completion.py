"""`kvtop completion bash|zsh|fish`: a shell completion script generated from kvtop's own parser.

The script is generated (shtab) from the argparse tree the CLI runs on, so every command, option
and choice completes, and a new one completes without anyone editing a script.
"""

from __future__ import annotations

import argparse
import sys

from kvtop.errors import UsageError

NAME = "completion"
HELP = "print a shell completion script (bash, zsh or fish) generated from kvtop's options"
DESCRIPTION = (
    "Prints the completion script for SHELL on stdout. Install it once: "
    "bash: kvtop completion bash > ~/.local/share/bash-completion/completions/kvtop; "
    "zsh: kvtop completion zsh > \"${fpath[1]}/_kvtop\"; "
    "fish: kvtop completion fish > ~/.config/fish/completions/kvtop.fish"
)
ORDER = 90
SHELLS = ("bash", "zsh", "fish")

# options whose value is a path: the shell completes file names there
_PATH_METAVARS = {"FILE", "TRACE", "PATH", "DIR"}
_PATH_DESTS = {"trace", "output", "config", "plugin", "replay", "workload", "model_config", "scenario",
               "save_scenario", "token_file", "trace_dir", "record", "arrivals_from"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")


def run(args: argparse.Namespace) -> int:
    import shtab  # only here: the other commands never need it

    parser = getattr(args, "_parser", None)
    if not isinstance(parser, argparse.ArgumentParser):
        raise UsageError("completion: run it as `kvtop completion SHELL`")
    _mark_paths(parser, shtab.FILE)
    sys.stdout.write(shtab.complete(parser, shell=args.shell))
    return 0


def _mark_paths(parser: argparse.ArgumentParser, file_completion: object) -> None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases share a parser
                _mark_paths(sub, file_completion)
        elif action.choices is None and (action.metavar in _PATH_METAVARS or action.dest in _PATH_DESTS):
            setattr(action, "complete", file_completion)  # noqa: B010 (the attribute shtab reads; argparse has none)
