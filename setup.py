"""Package list only (everything else is in pyproject.toml).

``plugins/`` ships as ``kvtop_plugins`` via ``package-dir``; setuptools' ``packages.find`` cannot
discover a package that exists only through that mapping, so it is listed next to the found ones.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["kvtop", "kvtop.*"]), "kvtop_plugins"])
