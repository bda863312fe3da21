"""The engine as witness: per-step facts published from inside the inference engine.

``kvtop.witness.vllm`` is loaded by vLLM itself (``--scheduler-cls kvtop.witness.vllm.WitnessScheduler``)
and writes one JSON line per engine step (``kvtop.witness.steplog``). It runs inside the engine's
process, so this package imports nothing from the rest of kvtop and nothing outside the standard
library (an import contract keeps it so): installing ``kvtop-console --no-deps`` into the engine's
environment is enough. kvtop reads the file back with ``kvtop.sources.witness``.
"""
