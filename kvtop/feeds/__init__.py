"""What fills a Core: live sources on their own schedules, a trace file, the simulated demo.

Each feed satisfies ``kvtop.pipeline.Feed``; ``kvtop.pipeline`` picks and wires one per run.
"""
