"""Helpers for the console tests: the visible screen as plain text, and small fake feeds."""

from __future__ import annotations

import asyncio
from typing import Any


def screen_text(app: Any) -> str:
    """What a user sees right now (top screen, modal dialogs included), one line per row."""
    strips = app.screen._compositor.render_strips()
    return "\n".join("".join(seg.text for seg in strip).rstrip() for strip in strips)
