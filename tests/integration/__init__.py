# A package, so this directory's conftest is `integration.conftest` and never shadows tests/conftest.py
# (whose helpers other test modules import as `conftest`).
