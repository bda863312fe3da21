"""An independent trace generator for scoring kvtop's attribution (not part of the product package).

Stable interface (the evaluation scripts and tests rely on it):

* ``eval.tracegen.generate.simulate(name, seed, duration_s=None, observed_frac=None) -> Generated``:
  engine run + delivery for one situation (``eval.tracegen.situations.SITUATIONS``);
* ``eval.tracegen.generate.write(generated, path, interval_s=1.0) -> summary``: the kvtop trace for
  one scrape interval (the same run serves every interval);
* ``eval.tracegen.generate.generate(name, seed, path, interval_s=1.0, ...)``: both at once;
* ``python -m eval.tracegen.cli --situation NAME --seed N -o trace.jsonl [--scrape-interval S]``.

Module map: ``stepper`` (step-level engine model), ``situations`` (engines, traffic, delivery
settings), ``delivery`` (engine -> proxy), ``pages`` (/metrics text per engine family),
``generate`` (scrapes, records, truth), ``baseline`` (the docs/rules.md-table rule baseline).
"""
