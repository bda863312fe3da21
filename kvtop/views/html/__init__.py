"""The HTML report of a trace (``kvtop analyze TRACE --html FILE``): one self-contained page.

Inline CSS and inline SVG only: no script, no web font, no link to anything, so the page opens the
same from a ticket attachment on a machine without network. A pure renderer of
``kvtop.picture.Picture``: it lays out the facts the analysis produced and computes none.
"""

from kvtop.views.html.page import CAUSE_STYLE, MAX_TIMELINES, render_html

__all__ = ["CAUSE_STYLE", "MAX_TIMELINES", "render_html"]
