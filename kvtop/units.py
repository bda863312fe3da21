"""Numbers to text for every view: the plain-text report, ``kvtop analyze`` and the console.

One set of formatters so a quantity reads the same wherever it is shown. Where the text report
and the console deliberately differ (the console packs a GPU line into 80 columns, the report
spells units out), the difference is in the function's name (``*_short`` is the console's form),
not in a second copy. Unknown values -- ``None``, and NaN or infinity (a 0/0 rate, a histogram without a
sum) -- print as :data:`NA`, just as the JSON output writes them as ``null``.

Headless: no Textual, so the text paths and the benches can use it.
"""

from __future__ import annotations

import math

NA = "n/a"

# IEC steps for memory sizes; the text report spells the unit, the console keeps one letter.
_IEC = (("TiB", "T", 1 << 40), ("GiB", "G", 1 << 30), ("MiB", "M", 1 << 20), ("KiB", "K", 1 << 10))
# Link traffic is quoted in decimal units (PCIe and NVLink bandwidths are specified in GB/s).
_RATE = (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3))


def unknown(v: float | None) -> bool:
    """True for a value no view should print as a number."""
    return v is None or not math.isfinite(v)


# -- sizes and link rates ------------------------------------------------------------------------
def bytes_iec(v: float | None) -> str:
    """A memory size with its IEC unit spelled out: ``512 B``, ``69.0 GiB``, ``3.0 TiB``."""
    if v is None or unknown(v):
        return NA
    x = float(v)
    for unit, _, div in _IEC:
        if abs(x) >= div:
            return f"{x / div:.1f} {unit}"
    return f"{x:.0f} B"


def bytes_short(v: float | None) -> str:
    """A memory size in the console's compact form: ``512B``, ``61.2G``."""
    if v is None or unknown(v):
        return NA
    for _, letter, div in _IEC:
        if abs(v) >= div:
            return f"{v / div:.1f}{letter}"
    return f"{int(v)}B"


def _rate(v: float | None, digits: int) -> str:
    if v is None or unknown(v):
        return NA
    x = float(v)
    for unit, div in _RATE:
        if abs(x) >= div:
            return f"{x / div:.{digits}f} {unit}"
    return f"{x:.0f} B/s"


def byte_rate(v: float | None) -> str:
    """Link traffic in decimal units to two decimals: ``12.60 GB/s``, ``3.00 kB/s``, ``999 B/s``."""
    return _rate(v, 2)


def byte_rate_short(v: float | None) -> str:
    """The console's link traffic, one decimal: ``12.6 GB/s``."""
    return _rate(v, 1)


# -- time ----------------------------------------------------------------------------------------
def duration(s: float | None) -> str:
    """A latency with a spaced unit: ``73.4 ms`` below a second, ``1.65 s`` above."""
    if s is None or unknown(s):
        return NA
    return f"{s * 1000:.1f} ms" if abs(s) < 1 else f"{s:.2f} s"


def duration_short(s: float | None) -> str:
    """The console's short form: ``73ms``, ``1.65s``, ``300s`` (whole seconds from 100 s)."""
    if s is None or unknown(s):
        return NA
    if s < 1.0:
        return f"{s * 1000:.0f}ms"
    if s < 100:
        return f"{s:.2f}s"
    return f"{s:.0f}s"


# -- counts, shares, rates -----------------------------------------------------------------------
def count(v: float | None, digits: int = 0) -> str:
    """A count with thousands separators: ``1,234,567``; a fractional one keeps ``digits`` (1 at least)."""
    if v is None or unknown(v):
        return NA
    if digits == 0 and float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:,.{digits or 1}f}"


def count_short(v: float | None) -> str:
    """A count in a chart's gutter: whole from 10 up (``12``), one decimal below (``2.5``)."""
    if v is None or unknown(v):
        return NA
    return f"{v:.0f}" if v >= 10 or v == int(v) else f"{v:.1f}"


def pct(v: float | None, digits: int = 1) -> str:
    """A 0..1 share as a percentage: ``93.3%`` (``digits=0``, a chart axis: ``93%``)."""
    return NA if v is None or unknown(v) else f"{v * 100:.{digits}f}%"


def per_s(v: float | None, digits: int = 1) -> str:
    """Events or tokens per second with thousands separators: ``8,312.3/s``."""
    return NA if v is None or unknown(v) else f"{v:,.{digits}f}/s"


def tok_rate(v: float | None) -> str:
    """Tokens per second in the console's width: ``8312``, ``12.5k`` from 10,000."""
    if v is None or unknown(v):
        return NA
    return f"{v / 1000:.1f}k" if v >= 10_000 else f"{v:.0f}"


def num(v: float | None, template: str = "{:.1f}") -> str:
    """Any number through a ``str.format`` template (``"{:.2f}/s"``, ``"{:.0%}"``)."""
    return NA if v is None or unknown(v) else template.format(v)


# -- the analysis' numbers (a value with a unit name, as the advisor reports them) ----------------
def _sig(x: float, digits: int = 3) -> str:
    """``digits`` significant digits, never an exponent, no trailing zeros: ``0.29``, ``85``, ``12.5``."""
    if x == 0:
        return "0"
    d = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    text = f"{x:.{d}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _plain(v: float) -> str:
    """A number of any other unit: four significant digits below 10,000, whole with separators above
    (``131,072``, never ``1.311e+05``)."""
    if isinstance(v, int) or abs(v) >= 1e4:
        return f"{v:,.0f}" if abs(v) >= 1e4 else f"{v}"
    return f"{v:.4g}"


def _unit_after(unit: str, key: str) -> str:
    """`` tokens`` after the number, or nothing when the number's name already ends in its unit
    (``break_even_tokens 1``, not ``1 tokens``)."""
    if not unit or key.endswith("_" + unit):
        return ""
    return " " + unit


def quantity(v: object, unit: str, key: str = "") -> str:
    """``kvtop analyze``'s numbers table: seconds in ms below 10 s (three significant digits),
    sizes and rates in decimal GB/MB to three significant digits, bytes per something in IEC units,
    other units after four significant digits. Non-numbers print as they are."""
    if v is None:
        return NA
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if unknown(v):
        return NA
    if unit == "s":
        return f"{_sig(v * 1e3)} ms" if abs(v) < 10 else f"{v:.1f} s"
    if unit == "B":
        return f"{v / 1e9:.3g} GB" if abs(v) >= 1e8 else f"{v / 1e6:.3g} MB"
    if unit == "B/s":
        return f"{v / 1e9:.3g} GB/s" if abs(v) >= 1e8 else f"{v / 1e6:.3g} MB/s"
    if unit.startswith("B/"):  # B/token: a size per something
        return f"{bytes_iec(v)}/{unit[2:]}"
    return _plain(v) + _unit_after(unit, key)


def quantity_short(v: object, unit: str = "", key: str = "") -> str:
    """The console's verdict panel: the same numbers in its short forms. Without a unit, a name
    ending in ``_s`` or ``_bytes_per_s`` says what it is."""
    if v is None:
        return NA
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if unknown(v):
        return NA
    # the longer suffix first: "_bytes_per_s" also ends in "_s"
    if unit == "B/s" or (not unit and key.endswith("_bytes_per_s")):
        return byte_rate_short(v)
    if unit == "s" or (not unit and key.endswith("_s")):
        # below a second three significant digits, as the verdict's reasons quote them (0.29 ms, not 0ms)
        return f"{_sig(v * 1e3)}ms" if abs(v) < 0.9995 else duration_short(v)
    if unit == "B":
        return bytes_short(v)
    if unit.startswith("B/"):
        return f"{bytes_short(v)}/{unit[2:]}"
    text = f"{v:,.0f}" if float(v).is_integer() else f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return text + _unit_after(unit, key)
