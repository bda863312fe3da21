"""The paged KV block pool: free, cached (LRU) and held blocks, and shared-prefix reference counts.

A pool of ``n_blocks`` blocks of ``block_size`` tokens. A block is in exactly one of three places:
free and uncached; cached (refcount 0 but still hashed, so a later request can hit it; evicted
least-recently-freed first, tail blocks of a sequence before its head, as vLLM does); or held by a
running / swapping-in sequence. Blocks of a shared prefix are reference-counted: along a prefix the
refcount never increases, so a prefix needs only "how many leading blocks does each holder
reference" (``Prefix.holders``), and the blocks with refcount > 0 are the first ``max(holders)``.

The LRU holds two kinds of keys: ``("p", prefix_id)`` for a prefix's unreferenced resident blocks
and ``("r", seq_id)`` for a preempted sequence's own full blocks kept for its resume.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvtop.sim.seq import Seq


class Prefix:
    """One shared prefix's residency and references."""

    __slots__ = ("resident", "holders", "held", "materialiser")

    def __init__(self) -> None:
        self.resident = 0  # computed blocks on the GPU (held or cached), a head of the prefix
        self.holders: dict[str, int] = {}  # seq id -> leading prefix blocks it references
        self.held = 0  # max(holders): blocks with refcount > 0 (refcounts never increase along the prefix)
        self.materialiser: str | None = None  # the one sequence computing the prefix's missing blocks


class BlockPool:
    def __init__(self, n_blocks: int, block_size: int, prefix_caching: bool = True):
        self.n_blocks = n_blocks
        self.bs = block_size
        self.prefix_caching = prefix_caching
        self.free_uncached = n_blocks
        self.cached = 0
        self.lru: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.prefixes: dict[str, Prefix] = {}
        self.reserved: dict[int, int] = {}  # priority -> blocks kept for it and more important ones

    # --- capacity ---------------------------------------------------------------------------------

    def available(self) -> int:
        """Blocks a new allocation may use: free ones plus cached ones (evicted on demand)."""
        return self.free_uncached + self.cached

    @property
    def usage(self) -> float:
        return 1.0 - (self.free_uncached + self.cached) / self.n_blocks

    def set_reservations(self, by_priority: dict[int, float]) -> None:
        """KV share reserved for classes at least as important as each priority (0..1 of blocks)."""
        self.reserved = {p: int(frac * self.n_blocks) for p, frac in by_priority.items() if frac > 0}

    def can_take(self, need: int, prio: int) -> bool:
        """A request of priority ``prio`` may take ``need`` blocks: they exist, and taking them leaves
        at least the reservations of strictly more important priorities."""
        avail = self.free_uncached + self.cached
        if need > avail:
            return False
        if self.reserved:
            keep = sum(v for p, v in self.reserved.items() if p < prio)
            if keep:
                used = self.n_blocks - avail
                return used + need <= self.n_blocks - keep
        return True

    def take(self, k: int) -> None:
        """Allocate k uncomputed blocks (evicting cached ones, least recently freed first)."""
        if k <= self.free_uncached:
            self.free_uncached -= k
            return
        k -= self.free_uncached
        self.free_uncached = 0
        lru = self.lru
        while k > 0:
            key, cnt = next(iter(lru.items()))
            take = min(cnt, k)
            k -= take
            self.cached -= take
            if take == cnt:
                del lru[key]
            else:
                lru[key] = cnt - take
            if key[0] == "p":
                self.prefixes[key[1]].resident -= take

    # --- the cache --------------------------------------------------------------------------------

    def cache_add(self, key: tuple[str, str], k: int) -> None:
        if k <= 0:
            return
        self.lru[key] = self.lru.pop(key, 0) + k
        self.cached += k

    def cache_remove(self, key: tuple[str, str], k: int) -> None:
        cnt = self.lru.get(key, 0)
        if k <= 0 or not cnt:
            return
        k = min(k, cnt)
        self.cached -= k
        if k == cnt:
            del self.lru[key]
        else:
            self.lru[key] = cnt - k

    def drop_private_cache(self, s: Seq) -> None:
        """A sequence's own cached blocks can no longer be hit: they become free."""
        cnt = self.lru.pop(("r", s.id), 0)
        if cnt:
            self.cached -= cnt
            self.free_uncached += cnt

    # --- a sequence's blocks ----------------------------------------------------------------------

    def lookup(self, s: Seq) -> tuple[int, int]:
        """Prefix-cache hit for a sequence about to be scheduled: (shared blocks, own cached blocks)."""
        if not self.prefix_caching:
            return 0, 0
        full = (s.num_tokens - 1) // self.bs  # the last token is always computed
        sh, pb = 0, 0
        if s.prefix_id is not None:
            pb = min(s.prefix_tokens // self.bs, full)
            p = self.prefixes.get(s.prefix_id)
            sh = min(p.resident, pb) if p else 0
        own = 0
        if sh == pb:
            own = min(self.lru.get(("r", s.id), 0), full - sh)
        return sh, own

    def cached_hits(self, s: Seq, sh: int, own: int) -> int:
        """Of a lookup's hit blocks, those sitting in the cache (not free for new allocations)."""
        n = own
        if sh and s.prefix_id is not None:
            n += max(0, sh - self.prefixes[s.prefix_id].held)
        return n

    def acquire(self, s: Seq, sh: int, own: int) -> None:
        """Take the hit blocks found by ``lookup`` (they leave the cache / gain a reference)."""
        if sh:
            pid = _prefix_id(s)
            p = self.prefixes[pid]
            if sh > p.held:
                self.cache_remove(("p", pid), sh - p.held)
                p.held = sh
            p.holders[s.id] = sh
        if own:
            self.cache_remove(("r", s.id), own)
        self.drop_private_cache(s)  # blocks past the hit can never be reused (hash chain broken)
        s.blocks = sh + own
        s.shared = sh
        s.computed = (sh + own) * self.bs
        if s.prefix_id is not None:
            p = self.prefixes.setdefault(s.prefix_id, Prefix())
            pb = s.prefix_tokens // self.bs
            if sh < pb and p.materialiser is None and self.prefix_caching:
                p.materialiser = s.id
                s.materialising = True

    def acquire_shared_only(self, s: Seq, sh: int) -> None:
        """A swapped-in sequence re-references its resident prefix blocks (its private ones come
        back over the link)."""
        pid = _prefix_id(s)
        p = self.prefixes[pid]
        if sh > p.held:
            self.cache_remove(("p", pid), sh - p.held)
            p.held = sh
        p.holders[s.id] = sh
        s.shared = sh

    def materialise(self, s: Seq) -> None:
        """Prefix blocks this sequence has computed become shared, hashed prefix blocks."""
        p = self.prefixes[_prefix_id(s)]
        pb = s.prefix_tokens // self.bs
        new = min(pb, s.computed // self.bs, s.blocks)
        if new > s.shared:
            if new > p.resident:
                p.resident = new
            p.holders[s.id] = new
            if new > p.held:
                p.held = new
            s.shared = new
        if new >= pb:
            s.materialising = False
            p.materialiser = None

    def release_prefix(self, s: Seq) -> None:
        if not s.shared:
            return
        pid = _prefix_id(s)
        p = self.prefixes[pid]
        p.holders.pop(s.id, None)
        new_held = max(p.holders.values(), default=0)
        self.cache_add(("p", pid), p.held - new_held)
        p.held = new_held
        if p.materialiser == s.id:
            p.materialiser = None
        s.shared = 0

    def free_all(self, s: Seq, keep_private_cache: bool) -> dict[str, int]:
        """Free a sequence's blocks: private ones to the pool (full ones stay cached if asked),
        shared prefix blocks only lose a reference. Returns what happened for truth records."""
        private = s.blocks - s.shared
        shared = s.shared
        cached_private = 0
        if keep_private_cache and self.prefix_caching:
            cached_private = max(0, min(private, s.computed // self.bs - s.shared))
        # Tail blocks go into the LRU first, so they are evicted before the head (vLLM order).
        self.free_uncached += private - cached_private
        self.cache_add(("r", s.id), cached_private)
        self.release_prefix(s)
        if s.materialising:
            s.materialising = False
            p = self.prefixes.get(_prefix_id(s))
            if p is not None and p.materialiser == s.id:
                p.materialiser = None
        s.blocks = 0
        return {"private_blocks": private, "shared_blocks": shared, "cached_private_blocks": cached_private}

    # --- checks (tests) ---------------------------------------------------------------------------

    def check_invariants(self, holders: Iterable[Seq]) -> None:
        """Every block is in exactly one place; ``holders``: the sequences that hold blocks."""
        held_private = sum(s.blocks - s.shared for s in holders)
        prefix_resident = sum(p.resident for p in self.prefixes.values())
        private_cached = sum(c for k, c in self.lru.items() if k[0] == "r")
        total = self.free_uncached + held_private + prefix_resident + private_cached
        assert total == self.n_blocks, (total, self.n_blocks, self.free_uncached, held_private, prefix_resident,
                                        private_cached)
        assert self.cached == sum(self.lru.values())
        for pid, p in self.prefixes.items():
            assert p.held == max(p.holders.values(), default=0)
            assert self.lru.get(("p", pid), 0) == p.resident - p.held, (pid, p.resident, p.held)


def _prefix_id(s: Seq) -> str:
    """The prefix of a sequence that holds or computes shared blocks (it always has one)."""
    pid = s.prefix_id
    assert pid is not None, s.id
    return pid
