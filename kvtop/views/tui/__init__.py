"""The Textual console. Only this package imports Textual; ``fmt`` and ``sample`` stay importable
without it (the bench and the headless tests use them)."""
