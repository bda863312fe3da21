"""kvtop.units: the one formatter set the text report, `kvtop analyze` and the console share.

Each view keeps its own form of a quantity (the report spells units, the console packs them);
these pin both forms on real magnitudes and the one placeholder for unknown values.
"""

from __future__ import annotations

import math

import pytest

from kvtop import units

GIB = 1 << 30


def test_memory_sizes_are_binary_in_both_views_spelled_out_in_text():
    # an H100's 80 GiB framebuffer with 69.4 GiB used
    assert units.bytes_iec(69.4 * GIB) == "69.4 GiB" and units.bytes_short(69.4 * GIB) == "69.4G"
    assert units.bytes_iec(80 * GIB) == "80.0 GiB" and units.bytes_short(80 * GIB) == "80.0G"
    # below one KiB the bytes are counted whole; one KiB switches unit
    assert units.bytes_iec(1023) == "1023 B" and units.bytes_short(1023) == "1023B"
    assert units.bytes_iec(1024) == "1.0 KiB" and units.bytes_short(1024) == "1.0K"
    assert units.bytes_iec(512 << 20) == "512.0 MiB" and units.bytes_short(512 << 20) == "512.0M"
    # a 3 TiB host stays in TiB (no PiB step)
    assert units.bytes_iec(3 << 40) == "3.0 TiB" and units.bytes_iec(2048 << 40) == "2048.0 TiB"


def test_analysis_numbers_are_decimal_where_memory_views_are_binary():
    # 10^9 bytes: the advisor's "bytes moved" reads 1 GB, the memory views 953.7 MiB
    assert units.quantity(1e9, "B") == "1 GB"
    assert units.bytes_iec(1e9) == "953.7 MiB" and units.bytes_short(1e9) == "953.7M"
    # below 0.1 GB the analysis switches to MB, three significant digits
    assert units.quantity(0.129e9, "B") == "0.129 GB" and units.quantity(9.6e7, "B") == "96 MB"


def test_link_rates_are_decimal_two_decimals_in_text_one_in_the_console():
    assert units.byte_rate(12.6e9) == "12.60 GB/s" and units.byte_rate_short(12.6e9) == "12.6 GB/s"
    assert units.byte_rate(4.5e6) == "4.50 MB/s" and units.byte_rate_short(4.5e6) == "4.5 MB/s"
    assert units.byte_rate(1500) == "1.50 kB/s" and units.byte_rate(999) == "999 B/s"
    assert units.byte_rate_short(13.4e9) == "13.4 GB/s"
    # the analysis' effective bandwidth: three significant digits
    assert units.quantity(43.7e9, "B/s") == "43.7 GB/s" and units.quantity(2.5e7, "B/s") == "25 MB/s"


def test_durations_in_each_views_form():
    # text report: ms with a decimal below one second, seconds with two decimals above
    assert units.duration(0.0734) == "73.4 ms" and units.duration(1.65) == "1.65 s"
    assert units.duration(0.999) == "999.0 ms" and units.duration(1.0) == "1.00 s"
    # console: whole ms, two decimals to 100 s, whole seconds after
    assert units.duration_short(0.0734) == "73ms" and units.duration_short(1.65) == "1.65s"
    assert units.duration_short(300) == "300s" and units.duration_short(99.5) == "99.50s"
    # kvtop analyze's numbers table stays in ms up to 10 s, three significant digits
    assert units.quantity(0.0029, "s") == "2.9 ms" and units.quantity(9.9, "s") == "9900 ms"
    assert units.quantity(0.00029, "s") == "0.29 ms" and units.quantity(0.41, "s") == "410 ms"
    assert units.quantity(12.5, "s") == "12.5 s"


def test_counts_rates_and_shares():
    assert units.count(452_000) == "452,000" and units.count(3.0) == "3" and units.count(0.5) == "0.5"
    assert units.count(1234.5678, 2) == "1,234.57"
    assert units.per_s(8312.345) == "8,312.3/s" and units.per_s(0.1133, 2) == "0.11/s"
    assert units.pct(0.9334) == "93.3%" and units.pct(0.9334, digits=0) == "93%" and units.pct(1.0) == "100.0%"
    # the console's token rates: whole below 10k, thousands with a k above
    assert units.tok_rate(8312.3) == "8312" and units.tok_rate(12_500) == "12.5k"
    assert units.count_short(12.4) == "12" and units.count_short(2.5) == "2.5" and units.count_short(3.0) == "3"
    assert units.num(0.8567, "{:.0%}") == "86%" and units.num(0.1133, "{:.2f}/s") == "0.11/s"


def test_analysis_numbers_with_other_units_and_non_numbers():
    # KV bytes per token of an 8B model at bf16: 131,072 B, in the memory views' IEC units
    assert units.quantity(131072.0, "B/token") == "128.0 KiB/token"
    assert units.quantity_short(131072, "B/token") == "128.0K/token"
    # never an exponent; a name that ends in its unit does not repeat it
    assert units.quantity(123456.7, "tokens") == "123,457 tokens"
    assert units.quantity(1, "tokens", "break_even_tokens") == "1"
    assert units.quantity_short(1, "tokens", "break_even_tokens") == "1"
    assert units.quantity(982.3, "tokens") == "982.3 tokens" and units.quantity(7, "") == "7"
    assert units.quantity(0.0002406, "") == "0.0002406"
    assert units.quantity(True, "") == "True" and units.quantity("swap", "") == "swap"
    # the console's verdict panel: the unit, or else the number's name, picks the short form
    # below a second three significant digits, as the verdict's reasons quote them
    assert units.quantity_short(0.0029, "s") == "2.9ms" and units.quantity_short(0.0029, "", "t_out_s") == "2.9ms"
    assert units.quantity_short(0.00029, "s", "swap_gpu_s") == "0.29ms" and units.quantity_short(0.085, "s") == "85ms"
    assert units.quantity_short(4.37e10, "", "bw_bytes_per_s") == "43.7 GB/s"
    assert units.quantity_short(24 * GIB, "B") == "24.0G"
    assert units.quantity_short(1234.0, "tokens") == "1,234 tokens" and units.quantity_short(0.2406, "") == "0.2406"
    assert units.quantity_short([1, 2], "") == "[1, 2]"


ALL_NUMERIC = (units.bytes_iec, units.bytes_short, units.byte_rate, units.byte_rate_short, units.duration,
               units.duration_short, units.count, units.count_short, units.pct, units.per_s, units.tok_rate,
               units.num, lambda v: units.quantity(v, "s"), lambda v: units.quantity(v, "B"),
               lambda v: units.quantity(v, "tokens"), lambda v: units.quantity_short(v, "s"))


@pytest.mark.parametrize("v", [None, math.nan, math.inf, -math.inf])
def test_unknown_values_print_the_placeholder_in_every_view(v):
    # a 0/0 rate or a histogram without a sum is NaN: it prints as unknown, never as "nan GiB"
    # (and never crashes the console, as int(nan) did in the old short byte format)
    assert [f(v) for f in ALL_NUMERIC] == ["n/a"] * len(ALL_NUMERIC)
