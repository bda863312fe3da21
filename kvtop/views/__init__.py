"""Renderings of a Snapshot: the plain-text summary, the Prometheus exporter, the Textual console.

Views only read a Snapshot (and the typed analysis report it holds); they never reach back into
the core or the sources. Only ``kvtop.views.tui`` imports Textual.
"""
