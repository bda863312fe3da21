"""Pieces every console view uses: ``Panel`` (markup that follows its own width) and ``Cells``
(table cells as Rich text in the current theme's colours, cached)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from rich.text import Text
from textual.widgets import Static

_THEME_VAR = re.compile(r"\$([a-z][a-z0-9-]*)")


class Panel(Static):
    """A Static whose markup depends on its own width; re-rendered on resize."""

    def __init__(self, builder: Callable[[int], str] | None = None, **kw: Any):
        super().__init__("", **kw)
        self.builder = builder
        self._shown: str | None = None

    def show(self, builder: Callable[[int], str]) -> None:
        self.builder = builder
        self._redraw()

    def _redraw(self) -> None:
        if self.builder is not None:
            width = self.size.width or self.app.size.width
            markup = self.builder(width)
            if markup != self._shown:  # unchanged panels cost nothing (no re-parse, no repaint)
                # the same number of lines: no layout pass (the Overview holds dozens of widgets)
                relayout = self._shown is None or markup.count("\n") != self._shown.count("\n")
                self._shown = markup
                self.update(markup, layout=relayout)

    def on_resize(self) -> None:
        self._redraw()


class Cells:
    """DataTable cells are Rich text: theme variables ($warning ...) resolve to the current theme's
    colours so severity still follows the theme. One cache for the console's tables; ``reset`` on
    a theme change."""

    def __init__(self, theme_variables: Callable[[], Mapping[str, str]]):
        self._vars = theme_variables
        self._cache: dict[str, Text] = {}

    def reset(self) -> None:
        self._cache = {}

    def __call__(self, markup: str) -> Text:
        t = self._cache.get(markup)
        if t is None:
            if len(self._cache) > 20000:
                self._cache.clear()
            t = Text.from_markup(_THEME_VAR.sub(self._colour, markup), end="")
            if len(t.spans) == 1 and t.spans[0].start == 0 and t.spans[0].end == len(t.plain):
                # a whole-cell colour as the base style renders far cheaper than a span
                t = Text(t.plain, style=t.spans[0].style, end="")
            self._cache[markup] = t
        return t

    def _colour(self, m: re.Match[str]) -> str:
        v = self._vars().get(m.group(1), "default")
        v = v.removeprefix("ansi_")
        return "dim" if m.group(1) == "text-muted" else v
