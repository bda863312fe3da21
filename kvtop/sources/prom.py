"""Prometheus page reading for kvtop's own code: the same implementation adapters get from the SDK."""

from kvtop.adapters.page import Labels, Page, parse_page, read_page

__all__ = ["Labels", "Page", "parse_page", "read_page"]
