"""The core: folds records into bounded state and derives Snapshots (docs/design.md §1).

Pure: no I/O, no threads, no Textual. Live runs, replays and simulations feed the same ``Core``;
the only difference is where the records come from. Memory is bounded whatever the run length.

One tracker a kind of record, each deriving its own events into the one event log: engines.py
(scraped engine metrics), gpus.py (GPU readings), requests.py (request streams), events.py (the
log, and the verdict changes); kvtop/history.py keeps the console's chart series. core.py composes
them into ``Core``.
"""

from kvtop.core.core import Core
from kvtop.core.requests import TIMELINE_MAX_CHUNKS

__all__ = ["TIMELINE_MAX_CHUNKS", "Core"]
