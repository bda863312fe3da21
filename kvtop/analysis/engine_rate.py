"""The engine's own prefill rate: prompt tokens it counted / the TTFT it summed, over all its requests.

kvtop's other rate samples need requests it observes: prompts of 256 tokens or more with a known
length at their first token, or the engine's per-request times on a finish record. A host where kvtop
sees part of the traffic, or traffic of short prompts whose usage comes only at the end, may give
neither for the whole run. The engine's counters give one from its first prefills, whoever sent
them: ``prompt_tokens_total`` over the sum of its TTFT histogram. TTFT holds queueing and the decode
work of the steps that prefilled, so this too is a low estimate (a prompt that it cannot make
explain a stall does not explain it). Read only where the engine's prompts average
``RATE_MIN_PROMPT`` tokens or more, the shortest prompt kvtop's own sample takes: a shorter prompt's
TTFT is the step it rode in, and on real vLLM with prompts of 50-75 tokens the ratio read a rate so
low that it explained nearly any stall (docs/real-engines.md §7.11).
"""

from __future__ import annotations

from collections.abc import Hashable

from kvtop.analysis.asof import History

MIN_PROMPTS = 5  # first tokens the engine counted before its ratio is read (as the other samples' median)
# prompt tokens: the shortest prompt whose TTFT says something of a prefill rate (kvtop's own TTFT
# sample and this ratio alike)
RATE_MIN_PROMPT = 256


class _Sums:
    __slots__ = ("prompt", "ttft", "firsts", "last")

    def __init__(self) -> None:
        self.prompt = self.ttft = self.firsts = 0.0
        self.last: tuple[float, float, float] | None = None  # the counters as last read


class EnginePrefillRate:
    """Cumulative prompt tokens / TTFT seconds per engine instance, and over all of them, as of each scrape."""

    def __init__(self) -> None:
        self._sums: dict[Hashable, _Sums] = {}
        self._group: dict[Hashable, str | None] = {}
        self.history: dict[str | None, History] = {}  # None: every instance together

    def add(self, t: float, key: Hashable, group: str | None, prompt: float | None, ttft: object) -> None:
        """A scrape of instance ``key`` (of engine address ``group``) at trace time ``t``: its prompt
        counter and its TTFT histogram (``{"count", "sum"}``)."""
        if prompt is None or not isinstance(ttft, dict):
            return
        n, s = ttft.get("count"), ttft.get("sum")
        if not isinstance(n, (int, float)) or not isinstance(s, (int, float)):
            return
        st = self._sums.get(key)
        if st is None:
            st = self._sums[key] = _Sums()
            self._group[key] = group
        cur = (float(prompt), float(s), float(n))
        if st.last is not None:
            # a counter that went back is a restart: count the new process from zero
            if all(c >= p for c, p in zip(cur, st.last, strict=True)):
                st.prompt += cur[0] - st.last[0]
                st.ttft += cur[1] - st.last[1]
                st.firsts += cur[2] - st.last[2]
            else:
                st.prompt, st.ttft, st.firsts = st.prompt + cur[0], st.ttft + cur[1], st.firsts + cur[2]
        else:
            st.prompt, st.ttft, st.firsts = cur
        st.last = cur
        for g in {None, group}:
            rate = self._rate(g)
            if rate is not None:
                self.history.setdefault(g, History()).record(t, rate)

    def _rate(self, group: str | None) -> float | None:
        p = s = n = 0.0
        for k, st in self._sums.items():
            if group is None or self._group[k] == group:
                p, s, n = p + st.prompt, s + st.ttft, n + st.firsts
        return p / s if n >= MIN_PROMPTS and s > 0 and p >= RATE_MIN_PROMPT * n else None

    def at(self, t: float, group: str | None = None) -> float | None:
        """The rate as of trace time ``t`` (of engine address ``group``'s instances when given)."""
        h = self.history.get(group)
        return None if h is None else h.at(t)

    def prune(self, before: float) -> None:
        for h in self.history.values():
            h.prune(before)
