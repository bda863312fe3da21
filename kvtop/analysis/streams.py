"""The per-stream store: one record per request, in arrival order, capped.

``Streams`` is the store itself, over any record that says whether its stream has ended (the
oldest ended stream is dropped first when the store is full). Two folds keep their streams in one
each: gap detection (``gaps.GapTracker``: a ``StreamStore`` of ``ReqState``, which the stall index
and the analyzer read) and the Core's request view (``kvtop.core.requests``: what the console lists
per request, and a request's timeline). ``StreamStore.info`` is the read-only view of one analysed
stream; the Core's request view reads its spikes and their last cause from it.

The two folds count differently on purpose, and their outputs depend on it: gap detection counts an
event of ``n=0`` tokens as one, counts a token older than the stream's last, takes the silence
before a cancel as a gap, the first end event as the end and the arrive event as the arrival; the
request view counts ``n`` as given, skips a reordered token, measures token to token, shows the
latest end event and dates a request from its first record (tests/test_stream_facts.py shows each).
Merging them is a change of results, not of structure.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:  # types only: a stream refers to its spikes; gaps.py and attribution import this module
    from kvtop.analysis.attribution.spike import Spike
    from kvtop.analysis.gaps import Pending

RECENT = 8  # gaps per stream kept to judge whether a spike is an outlier for that stream (and as many
# stall-free ones, within the target: the pace before a slowdown began)


@dataclass(slots=True)
class ReqState:
    """One stream (request): what the analysis knows of it so far."""

    id: str
    arrive_t: float | None = None
    prompt_tokens: int | None = None
    cls: str | None = None
    first_t: float | None = None
    last_t: float | None = None
    tokens: int = 0
    end_t: float | None = None
    ended_by: str | None = None
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    recent_n: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT))  # tokens of the events closing them
    calm: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))  # recent gaps within the target
    max_gap: float = 0.0
    spikes: int = 0
    preempt_spikes: int = 0
    last_cause: str | None = None
    last_spike: Spike | None = None  # the stream's previous judged spike (its candidate and finding)
    engine_preempts: list[float] = field(default_factory=list)  # t of request-level preempt events (engine/sim)
    cancelled_after_preempt: bool = False
    events: int = 0  # token events (tokens / events: the stream's usual chunk size)
    watch: list[Pending] = field(default_factory=list)  # spikes of this stream still collecting their look-ahead
    engine: str | None = None  # the engine that served it (``engine_address`` of its record's engine)

    def tokens_per_event(self) -> float:
        return self.tokens / self.events if self.events else 1.0


class _Stream(Protocol):
    """What the store asks of a record: whether its stream has ended."""

    @property
    def end_t(self) -> float | None: ...


S = TypeVar("S", bound=_Stream)


class Streams(Generic[S]):
    """Records by request id, in arrival order; at most ``max_requests`` (when one more comes, the
    oldest ended stream is dropped first, else the oldest; ``on_drop`` hears which)."""

    def __init__(self, max_requests: int | None = None, on_drop: Callable[[str], None] | None = None):
        self.max_requests = max_requests
        self.by_id: OrderedDict[str, S] = OrderedDict()
        self._on_drop = on_drop

    def __len__(self) -> int:
        return len(self.by_id)

    def __iter__(self) -> Iterator[S]:
        return iter(self.by_id.values())

    def get(self, rid: str) -> S | None:
        return self.by_id.get(rid)

    def add(self, rid: str, r: S) -> S:
        """``r`` as stream ``rid`` (a new one: the store may drop another to stay within its cap)."""
        self.by_id[rid] = r
        if self.max_requests is not None and len(self.by_id) > self.max_requests:
            self._evict()
        return r

    def drop(self, rid: str) -> None:
        """Forget stream ``rid`` (its owner is done with it; ``on_drop`` is not told)."""
        del self.by_id[rid]

    def _evict(self) -> None:
        for k, v in self.by_id.items():
            if v.end_t is not None:
                del self.by_id[k]
                break
        else:
            k, _ = self.by_id.popitem(last=False)
        if self._on_drop is not None:
            self._on_drop(k)


class StreamStore(Streams[ReqState]):
    """The analysed streams (gap detection's)."""

    def req(self, rid: str) -> ReqState:
        """Stream ``rid``, added if new."""
        r = self.by_id.get(rid)
        if r is None:
            r = self.add(rid, ReqState(rid))
        return r
