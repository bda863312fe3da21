"""What the tests and the benches share, so neither imports the other: the fake NVML
(``fake_nvml``), the seeded fuzz mutators and invariants (``fuzzing``), and the real-engine helpers
(``engines``: install/build scripts, servers, load, running kvtop against them). Not shipped in the
wheel; import it from the repository root (pytest and ``python -m bench.X`` do).
"""
