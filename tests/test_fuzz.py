"""Fuzz suite, fast profile: seeded mutations of the in-repo engine captures, a trace and the shipped
scenarios through detection, every adapter, the scraper, the Core, the snapshot JSON, analyze
(both paths), replay and advise; and of the files a user writes (scenarios, workloads, model
configs, config.toml) through their loaders. Zero crashes, zero non-finite or negative numbers and
zero schema violations in snapshot JSON. The long profile is ``python -m bench.fuzz --cases 100000``
(``--per-kind`` for a count per kind)."""

from __future__ import annotations

import random

import pytest

from testkit.fuzzing import ADAPTERS, CAPTURES, Stats, page_case, run

CASES_PER_SEED = 250  # x 4 seeds: 1,000 cases: ~330 pages, ~250 traces, ~420 user files


@pytest.mark.parametrize("seed", [11, 23, 37, 41])
def test_fuzz_fast_profile(seed, tmp_path):
    stats = run(CASES_PER_SEED, seed, tmp_path)
    print(f"seed {seed}: {dict(stats)}")
    assert stats["cases"] == CASES_PER_SEED
    assert stats["snapshots"] > 0 and stats["analyses"] > 0 and stats["replays"] > 0
    assert stats["failures"] == 0, "\n".join(stats.failures)


def test_every_capture_through_every_adapter_mutated():
    """Each capture is mutated and read by all five adapters at least once."""
    rnd = random.Random(5)
    stats = Stats()
    for _ in range(2):
        for cap in CAPTURES:
            page_case(rnd, stats, all_adapters=True, capture=cap)
    assert stats["adapter_parses"] == 2 * len(CAPTURES) * len(ADAPTERS)
    assert stats["failures"] == 0, "\n".join(stats.failures)


@pytest.mark.parametrize("kind", ["scenario", "workload", "model_config", "config"])
def test_fuzz_files_a_user_writes(kind, tmp_path):
    """Each loader alone: deep nesting, huge numbers, wrong types, wrong encodings, cut files."""
    stats = run(150, 7, tmp_path, kinds=(kind,))
    refused = {"scenario": "refused_scenarios", "workload": "refused_workloads",
               "model_config": "refused_model_configs", "config": "refused_configs"}[kind]
    assert stats["cases"] == 150 and stats[refused] > 0 and stats[refused] < 150  # some pass, some are refused
    assert stats["failures"] == 0, "\n".join(stats.failures)
