"""What fills a Core: live sources on their own schedules, a trace file, the simulated demo,
Prometheus (a fleet feed), and the console's feed while no engine answers yet.

Each feed satisfies ``kvtop.pipeline.Feed``; every live source satisfies
``kvtop.feeds.sources.Source``; ``kvtop.pipeline`` picks and wires them, one feed per run.
"""
