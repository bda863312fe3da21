"""`kvtop plugins`: list installed engine adapters without importing them."""

from __future__ import annotations

import argparse
import json

NAME = "plugins"
HELP = "list installed engine adapters (nothing is imported)"
ORDER = 90


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=("text", "json"), default="text")


def run(args: argparse.Namespace) -> int:
    from kvtop.plugin import list_adapters

    adapters = list_adapters()
    if args.format == "json":
        print(json.dumps([a.__dict__ for a in adapters], indent=2))
        return 0
    width = max((len(a.name) for a in adapters), default=4)
    for a in adapters:
        origin = f"{a.dist} {a.version}" if a.version else (a.dist or "")
        print(f"{a.name:<{width}}  {a.target}  ({origin})")
    return 0
