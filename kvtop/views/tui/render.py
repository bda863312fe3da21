"""Snapshot -> Textual Content markup for each panel. Colours are theme variables ($warning,
$error, ...) so every theme, the low-colour one included, decides what severity looks like."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter

from textual.content import Content
from textual.markup import escape

from kvtop import units
from kvtop.model.analysis import Number, SpikeView
from kvtop.model.records import HostRecord
from kvtop.snapshot import EngineView, GpuView, RequestTimeline, RequestView, Snapshot
from kvtop.views.tui import fmt
from kvtop.views.tui.charts import preempt_rate

CAUSE_VAR = {
    "preemption": "$error",
    "prefill_interference": "$warning",
    "slow_decode": "$secondary",
    "unknown": "$text-muted",
}


def sev(text: str, level: str) -> str:
    var = fmt.SEV_VAR.get(level)
    if level == "ok" or var is None:
        return text
    return f"[{var}]{text}[/]"


def muted(text: str) -> str:
    return f"[$text-muted]{text}[/]"


def fit_line(parts: Sequence[tuple[str, int]], width: int, sep: str = "  ") -> str:
    """One line of (markup, drop rank) parts in display order, two spaces apart, within ``width``
    cells: while it is too wide the part with the highest rank goes (rank 0 parts always stay)."""
    kept = [(m, r, n) for m, r in parts if (n := Content.from_markup(m).cell_length)]

    def length() -> int:
        return sum(n for _, _, n in kept) + len(sep) * max(0, len(kept) - 1)

    while length() > width:
        rank = max(r for _, r, _ in kept)
        if rank == 0:
            break
        i = max(i for i, (_, r, _) in enumerate(kept) if r == rank)
        del kept[i]
    return sep.join(m for m, _, _ in kept)


def bar(used: int | None, reserved: int | None, total: int | None, width: int) -> str:
    u, r, f = fmt.mem_bar(used, reserved, total, width)
    return f"[$primary]{'█' * u}[/][$secondary]{'▒' * r}[/]{muted('░' * f)}"


def kv_bar(u: float | None, width: int) -> str:
    if u is None:
        return muted("·" * width)
    n = min(width, round(u * width))
    return f"{sev('█' * n, fmt.sev_kv(u)) if fmt.sev_kv(u) != 'ok' else '[$success]' + '█' * n + '[/]'}{muted('░' * (width - n))}"


# -- overview -----------------------------------------------------------------------------------
def gpu_line(view: GpuView, width: int) -> str:
    """One GPU. Wide terminals get TX/RX sparklines against the link's current capacity; narrow
    ones collapse to one line of numbers."""
    g = view.record
    name = (g.name or "").replace("NVIDIA ", "")
    head = f"[b]GPU{g.index}[/b] {escape(name[:18]):<18}" if width >= 100 else f"[b]GPU{g.index}[/b]"
    if g.lost:
        return f"{head} {sev('LOST — fell off the bus or the driver lost it', 'crit')}"
    mem = f"{units.bytes_short(g.mem_used_bytes)}/{units.bytes_short(g.mem_total_bytes)}"
    link = "n/a"
    if g.pcie_link_gen is not None:
        link = f"Gen{g.pcie_link_gen}x{g.pcie_link_width or '?'}"
        if view.link_downtrained:
            link = sev(f"{link}▼ (max Gen{g.pcie_link_gen_max}x{g.pcie_link_width_max})", "warn")
    cap = view.pcie_capacity_bytes_per_s
    util = f"util {units.num(g.util_pct, '{:.0f}%')}"

    def share(v: float | None) -> str:
        if v is None or not cap:
            return ""
        return muted(f" {v / cap * 100:.0f}%")

    if width >= 100:
        # two lines: memory and link, then the traffic sparklines with the rest of the width
        sw = max(8, min(60, (width - 52) // 2))
        tx = f"TX {fmt.spark(view.pcie_tx_history, sw, cap)} {units.byte_rate_short(g.pcie_tx_bytes_per_s):>10}{share(g.pcie_tx_bytes_per_s)}"
        rx = f"RX {fmt.spark(view.pcie_rx_history, sw, cap)} {units.byte_rate_short(g.pcie_rx_bytes_per_s):>10}{share(g.pcie_rx_bytes_per_s)}"
        cap_txt = muted(f"  cap {units.byte_rate_short(cap)}") if cap else ""
        return (f"{head} {bar(g.mem_used_bytes, g.mem_reserved_bytes, g.mem_total_bytes, 24)} {mem:>11}  "
                f"{util:>8}  {link}{cap_txt}\n      {tx}   {rx}")
    bw = 8 if width >= 70 else 4
    return (f"{head} {bar(g.mem_used_bytes, g.mem_reserved_bytes, g.mem_total_bytes, bw)} {mem:>11} "
            f"TX {units.byte_rate_short(g.pcie_tx_bytes_per_s)}{share(g.pcie_tx_bytes_per_s)} "
            f"RX {units.byte_rate_short(g.pcie_rx_bytes_per_s)} {link}")


def host_line(h: HostRecord | None, width: int, status: str = "ok") -> str:
    if h is None:
        return f"[b]host[/b] {muted(escape(status) if status != 'ok' else 'no host data yet')}"
    used = None
    if h.mem_total_bytes is not None and h.mem_available_bytes is not None:
        used = h.mem_total_bytes - h.mem_available_bytes
    parts = [f"[b]host[/b] mem {bar(used, None, h.mem_total_bytes, 10 if width >= 100 else 6)} "
             f"{units.bytes_short(used)}/{units.bytes_short(h.mem_total_bytes)}"]
    signal = escape(h.pinned_signal) if h.pinned_signal else "no signal"
    parts.append(f"pinned {units.bytes_short(h.pinned_bytes)} {muted('(' + signal + ')')}")
    if width >= 100:
        parts.append(f"swap {units.bytes_short(h.swap_used_bytes)}/{units.bytes_short(h.swap_total_bytes)}")
        if h.cgroup_mem_max_bytes:
            parts.append(f"cgroup shmem {units.bytes_short(h.cgroup_shmem_bytes)}/{units.bytes_short(h.cgroup_mem_max_bytes)}")
    out = "  ".join(parts)
    for n in h.notes[:2]:
        out += "\n  " + muted(escape(n))
    return out


def engine_lines(e: EngineView, target: float | None, width: int, interval: float, window_s: float = 60.0) -> str:
    wide = width >= 100
    label = escape(e.url) + (f" [{escape(e.engine)}]" if e.engine not in (None, "", "0") else "")
    model = muted(escape(e.model.split("/")[-1])) if e.model else ""
    adapter = escape(e.adapter or "?")
    if not e.up:
        last = f"last good scrape {units.duration_short(e.stale_s)} ago" if e.stale_s is not None else "never scraped"
        why = escape(e.error or "no data yet")
        lines = [f"{sev('✖ ENGINE DOWN', 'crit')} {adapter} {label} {model}", f"  {sev(why, 'crit')} · {last}"]
        if e.kv_usage is not None:
            lines.append(f"  {muted('last known: KV ' + units.pct(e.kv_usage))}")
        return "\n".join(lines)
    stale = ""
    if e.stale_s is not None and e.stale_s > max(3.0, 3 * interval):
        stale = " " + sev(f"stale {units.duration_short(e.stale_s)}", "warn")
    restarts = " " + sev(f"restarted {e.restarts}x", "warn") if e.restarts else ""
    lines = [f"{sev('●', 'ok') if not stale else sev('●', 'warn')} [b]{adapter}[/b] {label} {model}{stale}{restarts}"]
    kv = e.kv_usage
    kvw = 20 if wide else 10
    kvtxt = sev(units.pct(kv), fmt.sev_kv(kv)) if kv is not None else muted(units.NA)
    hist = " " + muted(fmt.spark(e.kv_usage_history, 24, 1.0)) if wide and e.kv_usage_history else ""
    pr = e.preemptions_per_s
    if not e.preempts:
        pre = muted("preempt: never (engine)")
    else:
        pre_total = f" ({units.num(e.preemptions_total, '{:.0f}')} total)" if wide else ""
        pre = "preempt " + sev(preempt_rate(e, window_s), fmt.sev_preempt(pr)) + pre_total
    lines.append(f"  KV {kv_bar(kv, kvw)} {kvtxt}{hist}  run {units.num(e.running, '{:.0f}')} "
                 f"wait {units.num(e.waiting, '{:.0f}')}  {pre}")
    itl = (f"ITL p50 {sev(units.duration_short(e.itl_p50_s), fmt.sev_latency(e.itl_p50_s, target))} "
           f"p99 {sev(units.duration_short(e.itl_p99_s), fmt.sev_latency(e.itl_p99_s, target))}")
    if wide:
        tgt = muted(f" (target {units.duration_short(target)})") if target is not None else muted(" (no target)")
        lines.append(f"  prompt {units.tok_rate(e.prompt_tokens_per_s)} tok/s  gen {units.tok_rate(e.generation_tokens_per_s)} tok/s  "
                     f"{itl}{tgt}  TTFT p99 {units.duration_short(e.ttft_p99_s)}")
    else:
        tgt = muted(f"/{units.duration_short(target)}") if target is not None else ""
        lines.append(f"  tok/s in {units.tok_rate(e.prompt_tokens_per_s)} out {units.tok_rate(e.generation_tokens_per_s)}  "
                     f"{itl}{tgt}  TTFT99 {units.duration_short(e.ttft_p99_s)}")
    for w in e.warnings[:3]:
        lines.append("  " + sev("⚠ " + escape(w), "warn"))
    if len(e.warnings) > 3:
        lines.append("  " + muted(f"… {len(e.warnings) - 3} more warning(s)"))
    return "\n".join(lines)


def summary_line(s: Snapshot, narrow: bool = False) -> str:
    """The verdict in one line for the overview (the advisor screen has the rest)."""
    a = s.analysis
    v = a.verdict if a is not None else None
    if a is None or v is None:
        return muted("advisor: no analysis yet (press 4 for the advisor)")
    conf = v.confidence
    marg = " " + sev("marginal", "warn") if v.marginal else ""
    if v.tentative:
        marg += " " + sev("tentative", "warn")
    spikes = len(a.spikes)
    return (f"[b]advisor:[/b] {sev(escape(str(v.action)), 'warn' if v.action not in ('no_action', None) else 'ok')}"
            f" {muted('confidence')} {units.num(conf, '{:.0%}') if conf is not None else units.NA}{marg}"
            f"  {muted(f'{spikes} spike(s)' + ('' if narrow else ' since start') + ' · press 4')}")


# -- requests -----------------------------------------------------------------------------------
COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "request"), ("state", "state"), ("cls", "class"), ("tokens", "tokens"), ("age", "age"),
    ("gap", "cur gap"), ("max_gap", "max gap"), ("spikes", "spikes"), ("preempt", "preempt"),
    ("cause", "last cause"),
)
# What a narrow terminal hides first, so the preemption columns stay on an 80-column screen
# (docs/console.md): the request's age, its class, its token count, its current gap, its spike count.
# The id, state, max gap, preemptions and the last cause always show (as does the sort column).
DROP_FIRST = ("age", "cls", "tokens", "gap", "spikes", "state")
# Numbers sort worst/biggest first; text sorts A→Z.
NUMERIC = {"tokens", "age", "gap", "max_gap", "spikes", "preempt"}


def request_cells(r: RequestView, target: float | None) -> tuple[str, ...]:
    gap_sev = fmt.sev_latency(r.current_gap_s, target) if r.current_gap_s is not None else "ok"
    mg_sev = fmt.sev_latency(r.max_gap_s, target) if r.max_gap_s is not None else "ok"
    state = {"preempted": sev("preempted", "crit"), "error": sev("error", "crit"),
             "cancelled": muted("cancelled"), "finished": muted("finished")}.get(r.state, escape(r.state))
    if r.kept:
        state += muted("*")  # ended a while ago, kept for its stall (the status line says so)
    return (
        escape(r.id), state, escape(r.cls or "-"), str(r.tokens), units.duration_short(r.age_s),
        sev(units.duration_short(r.current_gap_s), gap_sev) if r.current_gap_s is not None else "-",
        sev(units.duration_short(r.max_gap_s), mg_sev) if r.max_gap_s is not None else "-",
        str(r.spikes) if r.spikes else "-",
        sev(str(r.preempt_spikes), "crit") if r.preempt_spikes else "-",
        f"[{CAUSE_VAR.get(r.last_cause, '$text-muted')}]{escape(r.last_cause)}[/]" if r.last_cause else "-",
    )


SORT_KEYS: dict[str, Callable[[RequestView], str | float]] = {
    "id": attrgetter("id"), "state": attrgetter("state"), "cls": lambda r: r.cls or "",
    "tokens": attrgetter("tokens"), "age": attrgetter("age_s"),
    "gap": lambda r: r.current_gap_s if r.current_gap_s is not None else -1.0,
    "max_gap": lambda r: r.max_gap_s if r.max_gap_s is not None else -1.0,
    "spikes": attrgetter("spikes"), "preempt": attrgetter("preempt_spikes"), "cause": lambda r: r.last_cause or "",
}



def words_match(hay: str, needle: str) -> bool:
    """The filter box's rule: every word of ``needle`` somewhere in ``hay`` (any case, any order)."""
    hay = hay.lower()
    return all(part in hay for part in needle.lower().split())


def matches(r: RequestView, needle: str) -> bool:
    return words_match(f"{r.id} {r.state} {r.cls or ''} {r.last_cause or ''} {r.source or ''}", needle)


# -- request detail -----------------------------------------------------------------------------
def detail(rv: RequestView | None, tl: RequestTimeline | None, spikes: Sequence[SpikeView],
           target: float | None, now: float, width: int) -> str:
    if tl is None and rv is None:
        return muted("No request selected. Pick one on the Requests screen (2) and press Enter.")
    rid = rv.id if rv else tl.id  # type: ignore[union-attr]
    lines = []
    if rv is not None:
        lines.append(
            f"[b]{escape(rid)}[/b]  {escape(rv.state)}  {escape(rv.cls or '-')}  {rv.tokens} tokens  "
            f"age {units.duration_short(rv.age_s)}  max gap {sev(units.duration_short(rv.max_gap_s), fmt.sev_latency(rv.max_gap_s, target))}"
            f"  spikes {rv.spikes} ({rv.preempt_spikes} preemption)"
        )
    if tl is None or not tl.tokens:
        lines.append(muted("no token timings for this request (yet)"))
        return "\n".join(lines)
    t0 = tl.arrive_t
    t1 = tl.end_t if tl.end_t is not None else now
    own = [s for s in spikes if s.request_id == rid]
    attributed = bool(own)
    if not own and target is not None:
        # no analysis: still show gaps over the target, marked as unattributed
        prev = None
        for t, _n in tl.tokens:
            if prev is not None and t - prev > target:
                own.append(SpikeView(rid, prev, t, t - prev, "unknown"))
            prev = t
    w = max(20, width - 9)
    cols = fmt.timeline_cols(tl.tokens, t0, t1, w, own, tl.engine_marks, tl.marks)
    peak = max(cols.tokens) or 1
    tok_row = []
    for k in range(w):
        cause = cols.spike[k]
        if cause is not None and cols.tokens[k] == 0:
            tok_row.append(f"[{CAUSE_VAR.get(cause, '$text-muted')}]━[/]")
        elif cols.tokens[k]:
            tok_row.append("▁▂▃▄▅▆▇█"[min(7, max(0, round(cols.tokens[k] / peak * 7)))])
        else:
            tok_row.append(muted("·"))
    mark_row = [" "] * w
    for i, (c, _s) in enumerate(cols.spike_starts[:9]):
        mark_row[c] = f"[{CAUSE_VAR.get(str(_s.cause), '$text-muted')}]{i + 1}[/]"
    eng_row = []
    for m in cols.engine:
        eng_row.append({"P": "[$error]P[/]", "B": "[$warning]B[/]", "p": "[$error]p[/]", "r": "[$success]r[/]"}.get(m, " "))
    axis = [" "] * w
    for c, label in fmt.nice_ticks(0, t1 - t0, w, 12):
        for j, ch in enumerate(label):
            if c + j < w:
                axis[c + j] = ch
    legend = ("  ▅ tokens  ━ gap over target (colour = cause)  P preemption counter rose  B prompt burst"
              if width >= 120 else "  ━ gap over target  P preemption  B prompt burst")
    if tl.steps:
        legend += "  steps (witness): · decode  p prompt  R recompute"
    lines.append(muted(f"timeline {units.duration_short(t1 - t0)}, 1 column = {units.duration_short(cols.dt)}:{legend}"))
    lines.append("tokens │" + "".join(tok_row))
    lines.append("spikes │" + "".join(mark_row))
    lines.append("engine │" + "".join(eng_row))
    if tl.steps:
        # the engine's own steps for this request (a witness runs): what each column's steps did
        step_row = [" "] * w
        rank = {"d": 1, "p": 2, "r": 3}
        for a, _b, kind in tl.steps:
            if t0 <= a <= t1:
                c = min(w - 1, max(0, int((a - t0) / cols.dt)))
                if rank.get(kind, 0) > rank.get(step_row[c], 0):
                    step_row[c] = kind
        glyph = {"d": muted("·"), "p": "[$warning]p[/]", "r": "[$error]R[/]", " ": " "}
        lines.append("steps  │" + "".join(glyph[k] for k in step_row))
    lines.append("       └" + "".join(axis))
    kept = sum(n for _t, n in tl.tokens)
    if rv is not None and rv.tokens > kept:
        # a long request's timeline keeps its last chunks only: say so, or its rows contradict its
        # max gap and spikes (counted over the whole request) with an empty stretch at the start
        lines.append(muted(f"the console keeps a request's last {len(tl.tokens):,} chunks: its first "
                           f"{rv.tokens - kept:,} tokens (to +{units.duration_short(tl.tokens[0][0] - t0)}) are not "
                           "drawn; its max gap and spikes count them"))
    # gap per token, to scale against the largest gap: short steady gaps read as a flat floor
    gaps = [b[0] - a[0] for a, b in zip(tl.tokens, tl.tokens[1:], strict=False)]
    if gaps:
        top = max(gaps)
        # the whole request, each column the largest of its run of gaps: the last w gaps alone drew a
        # flat row under the scale of a spike that came before them
        runs = fmt.fold_max(gaps, w)
        k = -(-len(gaps) // len(runs))
        per = f", each column the largest of up to {k}" if k > 1 else ""
        lines.append(muted(f"gap per token ({len(gaps)} gaps{per}, top = {units.duration_short(top)}):"))
        lines.append("       │" + fmt.spark(runs, len(runs), top))
    lines.append("")
    head = "spikes (gaps over target)" + ("" if attributed else " — not attributed yet (their evidence is still "
                                                                 "arriving, or no analysis runs)")
    lines.append(f"[b]{head}[/b]")
    if not own:
        lines.append(muted("  none"))
    for i, s in enumerate(own[:9]):
        gap = s.gap_s or (s.t_end - s.t_start)
        ratio = f" ×{gap / target:.1f} target" if target else ""
        conf = s.confidence
        cause = s.cause or "unknown"
        lines.append(
            f"  [{CAUSE_VAR.get(cause, '$text-muted')}]{i + 1}[/] at +{units.duration_short((s.t_start or t0) - t0)}  "
            f"gap {units.duration_short(gap)}{muted(ratio)}  [{CAUSE_VAR.get(cause, '$text-muted')}]{escape(cause)}[/]"
            + (f" {muted('confidence')} {conf:.0%}" if conf is not None else "")
        )
    if len(own) > 9:
        lines.append(muted(f"  … {len(own) - 9} more"))
    marks = [m for m in tl.engine_marks]
    if marks:
        pre = sum(1 for m in marks if m[1] == "preemption")
        bursts = sum(1 for m in marks if m[1] == "prompt_burst")
        lines.append(muted(f"engine during this request: {pre} preemption-counter rise(s), {bursts} prompt burst(s)"))
    return "\n".join(lines)


# -- advisor ------------------------------------------------------------------------------------
_WOULD_CHANGE = {
    "swap": "shorter preempted requests (recompute gets cheaper) or a slower usable link",
    "recompute": "longer preempted requests or a faster usable link (the transfer gets cheaper)",
    "admission": "fewer preemptions per request (more KV headroom or fewer concurrent sequences)",
    "chunked_prefill": "spikes stop lining up with prompt bursts",
    "reduce_batch": "KV usage staying below 0.90 at the current batch",
    "scale_out": "less offered load, or a faster decode step (a batch within the ITL target that serves the load)",
    "no_action": "preemptions or spikes appearing in the window",
    "insufficient_data": "per-request token timings (run the proxy or --probe) and a few preemptions",
}


def would_change(action: str, numbers: Mapping[str, Number]) -> str:
    """What would change the verdict; for admission, cancellations are named only when the run saw
    preempted requests cancelled (cancel_prob > 0)."""
    text = _WOULD_CHANGE.get(action, "more data")
    cancel = numbers.get("cancel_prob")
    if action == "admission" and cancel is not None and isinstance(cancel.value, (int, float)) and cancel.value > 0:
        text = f"fewer cancellations of preempted requests ({cancel.value:.0%} now) or " + text
    return text


# The numbers an operator reads first (the cost model's inputs and outputs); the rest follow.
_KEY_NUMBERS = ("itl_target", "spike_share", "preemptions_per_completed", "kv_bytes_per_token_rank", "bw_eff",
                "prefill_rate", "cancel_prob", "seq_tokens", "bytes_moved", "t_out", "t_in", "swap_gpu_s",
                "recompute_gpu_s", "p_star", "break_even_tokens", "n_floor", "n_ceiling", "chunk_budget",
                "unchunked_step", "chunk_worst_step")


def advisor(s: Snapshot, width: int) -> str:
    a = s.analysis
    if a is None:
        return muted("No analysis yet. The advisor needs engine metrics and per-request token timings "
                     "(kvtop proxy or --probe).")
    v = a.verdict
    action = v.action if v is not None else "insufficient_data"
    conf = v.confidence if v is not None else None
    good = action in ("no_action",)
    head = f"[b]verdict:[/b] [b]{sev(escape(action.replace('_', ' ').upper()), 'ok' if good else 'warn')}[/b]"
    mech = v.mechanism if v is not None else None
    if mech and mech != action and len(str(mech)) <= 20:
        head += f"  {muted('eviction mechanism:')} {escape(str(mech))}"
    head += f"   confidence {conf:.0%}" if isinstance(conf, (int, float)) else "   confidence n/a"
    if v is not None and v.marginal:
        head += "   " + sev("MARGINAL (within ±30% of break-even)", "warn")
    if v is not None and v.tentative:
        # the first reason says what would confirm it (the advisor puts it there)
        head += "   " + sev("TENTATIVE", "warn")
    lines = [head]
    if v is not None and v.also:
        lines.append(f"also: {escape(', '.join(str(x).replace('_', ' ') for x in v.also))}")
    if mech and len(str(mech)) > 20:
        lines.append(f"why: {escape(str(mech))}")
    lines.append("")
    lines.append("[b]settings to change[/b]")
    items = [f.shown() for f in v.settings] if v is not None else []
    if items:
        lines.extend(f"  • {escape(x)}" for x in items)
    else:
        lines.append(muted("  none"))
    reasons = v.reasons if v is not None else ()
    if reasons:
        lines.append("")
        lines.append("[b]evidence[/b]")
        lines.extend(f"  • {escape(str(x))}" for x in reasons)
    lines.append("")
    lines.append("[b]what would change the verdict[/b]")
    nums = v.numbers if v is not None else {}
    lines.append(f"  • {escape(would_change(action, nums))}")
    rows = []
    for k in sorted(nums, key=lambda k: (_KEY_NUMBERS.index(k) if k in _KEY_NUMBERS else len(_KEY_NUMBERS), k)):
        num = nums[k]
        if num.value is None or isinstance(num.value, (list, dict, tuple)):
            continue  # tables (chunk plans, histograms, the deciding gates) are in `kvtop analyze`
        rows.append((str(k), units.quantity_short(num.value, num.unit, str(k)), num.source))
    if rows:
        lines.append("")
        lines.append("[b]numbers[/b]")
        kw = max(len(k) for k, _, _ in rows)
        vw = max(len(t) for _, t, _ in rows)
        for k, t, src in rows:
            lines.append(f"  {escape(k):<{kw}}  {escape(t):>{vw}}" + (f"  {muted(escape('[' + str(src) + ']'))}" if src else ""))
    causes = a.causes
    lines.append("")
    n_sp = a.spikes_total
    # a spike is judged once the scrapes around it are in: those still waiting are counted, not hidden
    wait = f", {a.pending_spikes} more pending: their evidence is still arriving" if a.pending_spikes else ""
    lines.append(f"[b]spike causes[/b] {muted(f'({n_sp} spikes since the start of the run{wait})')}")
    if not any(float(c.count or 0) for c in causes.values()):
        lines.append(muted("  no spikes"))
    bw = max(10, min(40, width - 50))
    for cause, c in sorted(causes.items(), key=lambda kv: (-float(kv[1].count or 0), kv[0])):
        if not c.count:
            continue
        share = float(c.share or 0.0)
        n = round(share * bw)
        col = CAUSE_VAR.get(cause, "$text-muted")
        mc = c.mean_confidence
        conf_txt = muted(f"  mean confidence {mc:.0%}") if isinstance(mc, (int, float)) else ""
        lines.append(f"  {escape(cause):<22} [{col}]{'█' * n}[/]{muted('░' * (bw - n))} {share:>4.0%}  "
                     f"({c.count}){conf_txt}")
    for w in a.warnings:  # what the analysis could not tell (a crowded target, a truncated trace)
        lines.append(sev(escape(f"  ! {w}"), "warn"))
    return "\n".join(lines)
