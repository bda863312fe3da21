"""Benches: scripts that measure and print figures. Run them as modules from the repository root
(``python -m bench.NAME``) so they import ``kvtop``, ``eval`` and ``testkit`` from this checkout."""
