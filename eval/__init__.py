"""Evaluation of kvtop's attribution, kept outside the product: the independent trace generator
(``eval.tracegen``), truth records read back from a trace (``eval.truth``), scoring against them
(``eval.scoring``), the confidence calibration (``eval.calibrate``, which writes
``kvtop/analysis/attribution/fitted.json``) and the accuracy matrices (``eval.attribution_matrix``,
``eval.attribution_accuracy``).

``kvtop`` never imports this package (an import-linter contract in pyproject.toml) and the wheel
does not ship it. Run its scripts as modules from the repository root, e.g.
``python -m eval.calibrate``.
"""
