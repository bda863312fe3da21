"""Readers of what users already have (benchmark results) into kvtop traces (``kvtop import``)."""
