"""``python -m kvtop.analysis.attribution --markdown``: print the rules table for docs/rules.md."""

from __future__ import annotations

import argparse
import sys

from kvtop.analysis.attribution.rules import markdown


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtop.analysis.attribution",
                                 description="Print the attribution rules table, generated from the rules' data.")
    ap.add_argument("--markdown", action="store_true", help="the table as Markdown (docs/rules.md, between its markers)")
    args = ap.parse_args(argv)
    if not args.markdown:
        ap.print_usage(sys.stderr)
        return 2
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
