"""The per-stream store: one record per request, in arrival order, capped, and the one fold of the
facts every reader of a stream shares.

``Streams`` is the store itself, over any record that says whether its stream has ended (the
oldest ended stream is dropped first when the store is full). ``StreamStore`` holds ``ReqState``
records: gap detection (``gaps.GapTracker``), the stall index and the analyzer read them, and so
does the Core's request view (``kvtop.core.requests``), which keeps its per-request timeline in the
same record (``ReqState.timeline``). With a live analysis the Core shares the analysis's store; on
its own (a replay without analysis) it keeps one and folds the facts itself with the same functions.

The facts (``fold_*``): tokens count an event's ``n``, or one when it has none (``n`` 0 or absent);
a token older than the stream's last is counted and its (negative) gap is no gap; ``max_gap`` is
token to token, and the silence from the last token to a cancel is ``end_silence`` (the analysis's
per-request maximum takes both); the first end event is the end, and the arrival is the arrive
event's. tests/test_stream_facts.py shows each on the view and the analysis alike.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:  # types only: a stream refers to its spikes; gaps.py and attribution import this module
    from kvtop.analysis.attribution.spike import Spike
    from kvtop.analysis.gaps import Pending

TIMELINE_MAX_CHUNKS = 1024
MAX_MARKS = 256
NO_GAP = -math.inf  # ``max_gap`` before a stream's second token
RECENT = 8  # gaps per stream kept to judge whether a spike is an outlier for that stream (and as many
# stall-free ones, within the target: the pace before a slowdown began)


class Chunks:
    """A request's token arrivals as two flat arrays (12 bytes a chunk; a deque of tuples costs
    ~90): at 20 requests/s this is most of what the console holds. Keeps the last TIMELINE_MAX_CHUNKS."""

    __slots__ = ("t", "n")

    def __init__(self) -> None:
        self.t = array("d")
        self.n = array("I")

    def append(self, t: float, n: int) -> None:
        self.t.append(t)
        self.n.append(max(0, n))
        if len(self.t) >= 2 * TIMELINE_MAX_CHUNKS:  # trim in batches: amortised O(1)
            del self.t[:-TIMELINE_MAX_CHUNKS]
            del self.n[:-TIMELINE_MAX_CHUNKS]

    def items(self) -> tuple[tuple[float, int], ...]:
        k = max(0, len(self.t) - TIMELINE_MAX_CHUNKS)
        return tuple(zip(self.t[k:], self.n[k:], strict=True))

    def __len__(self) -> int:
        return min(len(self.t), TIMELINE_MAX_CHUNKS)


@dataclass(slots=True)
class Timeline:
    """What the request view keeps of a stream beyond its facts: when it was first seen, through
    which source, its running state, and for the detail view its token chunks (in time order), its
    preempt/resume marks and its engine steps, bounded."""

    seen_t: float
    source: str | None = None
    state: str = "waiting"  # waiting, running, preempted (the end state is the facts' ``ended_by``)
    retired: bool = False  # ended and left the screens (kept only while among the worst stalls)
    chunks: Chunks = field(default_factory=Chunks)
    marks: list[tuple[float, str]] = field(default_factory=list)
    steps: deque[tuple[float, float, str]] = field(default_factory=lambda: deque(maxlen=TIMELINE_MAX_CHUNKS))

    def mark(self, t: float, ev: str) -> None:
        if len(self.marks) >= MAX_MARKS:
            del self.marks[0]
        self.marks.append((t, ev))


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
    max_gap: float = NO_GAP  # the longest token-to-token gap (NO_GAP before the second token)
    end_silence: float = 0.0  # from the last token to a cancel
    spikes: int = 0
    preempt_spikes: int = 0
    last_cause: str | None = None
    last_spike: Spike | None = None  # the stream's previous judged spike (its candidate and finding)
    engine_preempts: list[float] = field(default_factory=list)  # t of request-level preempt events (engine/sim)
    cancelled_after_preempt: bool = False
    events: int = 0  # token events (tokens / events: the stream's usual chunk size)
    watch: list[Pending] = field(default_factory=list)  # spikes of this stream still collecting their look-ahead
    engine: str | None = None  # the engine that served it (``engine_address`` of its record's engine)
    # the engine's own prefill of its prompt (first scheduled to first token, vLLM's per-request
    # metrics), on kvtop's clock; known once its finish record reports it
    engine_prefill: tuple[float, float] | None = None
    # when the prompt length and the engine's prefill became known (the trace time of the record
    # that told): a spike's judgement reads only what was known by its cut-off (``asof``)
    prompt_t: float = -math.inf
    engine_prefill_t: float = -math.inf
    timeline: Timeline | None = None  # the request view's part, while a Core lists the stream
    # the engine's count of its tokens at its finish (usage; None: none, or the finish said bytes of
    # the stream were lost) and whether it stopped (a stop's token is counted, sent as no text)
    usage: int | None = None
    stopped: bool = False
    multi_spikes: int = 0  # of its spikes, those closed by a record of more tokens than its records usually had
    lossy: bool = False  # tokens after a hole in the observed bytes: what the hole carried is not counted

    def tokens_per_event(self) -> float:
        return self.tokens / self.events if self.events else 1.0

    def longest_silence(self) -> float:
        """The longest wait the client saw: token to token, or from the last token to a cancel."""
        return max(self.max_gap, self.end_silence)


def merged_of(r: ReqState) -> int | None:
    """The tokens the engine counted for finished stream ``r`` beyond those its chunks numbered: they
    reached the client merged with others (None: no usage, or bytes of the stream were lost). Read
    when asked, not at the finish: a recorder that writes the finish before the last chunks (the
    generator's slow readers) still has them counted."""
    if r.usage is None or r.lossy:
        return None
    return max(0, r.usage - int(r.stopped) - r.tokens)


def fold_token(r: ReqState, t: float, k: int) -> float | None:
    """``k`` tokens delivered at ``t``; returns the previous token's time (None for the first)."""
    lt = r.last_t
    r.last_t = t
    r.tokens += k
    r.events += 1
    if lt is not None and t - lt > r.max_gap:
        r.max_gap = t - lt
    return lt


def fold_resync(r: ReqState, t: float, k: int) -> None:
    """Tokens after a hole in the observed bytes: counted, and the clock moves on without a gap."""
    r.lossy = True
    r.last_t = t
    r.tokens += k
    r.events += 1


def fold_arrive(r: ReqState, t: float, cls: str | None) -> None:
    r.arrive_t = t
    r.cls = cls


def fold_end(r: ReqState, t: float, how: str) -> bool:
    """A stream ended (finish / cancel / error); False when it had ended already (the first end is the end)."""
    if r.end_t is not None:
        return False
    r.end_t = t
    r.ended_by = how
    if how == "cancel" and r.last_t is not None and t - r.last_t > 0:
        r.end_silence = t - r.last_t
    return True


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
    """The streams: gap detection's, and the request view's with them."""

    def req(self, rid: str) -> ReqState:
        """Stream ``rid``, added if new."""
        r = self.by_id.get(rid)
        if r is None:
            r = self.add(rid, ReqState(rid))
        return r
