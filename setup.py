"""Package list that pyproject.toml alone cannot express.

``plugins/`` ships as the package ``kvtop_plugins`` (package-dir in pyproject.toml), but setuptools'
``packages.find`` ignores package-dir renames, so it silently left the built-in adapters out of the
wheel and out of editable installs. Everything else lives in pyproject.toml.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["kvtop", "kvtop.*"]), "kvtop_plugins"])
