"""`kvtop plugins`: list installed engine adapters; `--describe NAME` asks one what it reads."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvtop.errors import UsageError

NAME = "plugins"
HELP = "list installed engine adapters (nothing is imported unless --describe)"
ORDER = 90


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--describe", metavar="NAME",
                   help="load one adapter and print what it reads: normalised fields, preemption "
                        "semantics, the settings the advisor can name for it")


def _describe(name: str) -> dict[str, Any]:
    # the adapter registry (entry points) loads only when the command runs: the parser imports this module
    from kvtop.plugin import PluginError, load_adapter

    try:
        cls = load_adapter(name)
    except PluginError as e:
        raise UsageError(str(e)) from None
    return {
        "name": cls.name,
        "description": cls.description,
        "fields": sorted(cls.fields),
        "preempts": cls.preempts,
        "preempt_counted_at": cls.preempt_counted_at,
        "admits_in_order": cls.admits_in_order,
        "extra_paths": list(cls.extra_paths),
        # asked once per engine start (an operator's firewall or auth proxy must let them through too)
        "per_start_paths": [p for p in (cls.version_path, cls.limits_path) if p],
        "settings": {s.value: flag for s, flag in cls.settings.items()},
    }


def _print_description(d: dict[str, Any]) -> None:
    print(f"{d['name']}: {d['description']}")
    counted = f" (counted at {d['preempt_counted_at']})" if d["preempts"] and d["preempt_counted_at"] else ""
    print(f"preempts: {'yes' if d['preempts'] else 'never'}{counted}")
    print(f"admits prompts in arrival order: {'yes' if d['admits_in_order'] else 'not known'}")
    if d["extra_paths"]:
        print("also reads: " + ", ".join(d["extra_paths"]))
    if d["per_start_paths"]:
        print("reads once per engine start: " + ", ".join(d["per_start_paths"]))
    print("fields: " + ", ".join(d["fields"]))
    if d["settings"]:
        print("settings: " + ", ".join(f"{k} = {v}" for k, v in d["settings"].items()))


def run(args: argparse.Namespace) -> int:
    from kvtop.plugin import list_adapters  # see _describe

    if args.describe:
        d = _describe(args.describe)
        if args.format == "json":
            print(json.dumps(d, indent=2))
        else:
            _print_description(d)
        return 0
    adapters = list_adapters()
    if args.format == "json":
        print(json.dumps([a.__dict__ for a in adapters], indent=2))
        return 0
    width = max((len(a.name) for a in adapters), default=4)
    for a in adapters:
        origin = f"{a.dist} {a.version}" if a.version else (a.dist or "")
        print(f"{a.name:<{width}}  {a.target}  ({origin})")
    return 0
