"""An independent trace generator for scoring kvtop's attribution (not part of the product package).

Stable interface (benches and tests rely on it):

* ``bench.tracegen.generate.simulate(name, seed, duration_s=None, observed_frac=None) -> Generated``:
  engine run + delivery for one situation (``bench.tracegen.situations.SITUATIONS``);
* ``bench.tracegen.generate.write(generated, path, interval_s=1.0) -> summary``: the kvtop trace for
  one scrape interval (the same run serves every interval);
* ``bench.tracegen.generate.generate(name, seed, path, interval_s=1.0, ...)``: both at once;
* ``python bench/tracegen/cli.py --situation NAME --seed N -o trace.jsonl [--scrape-interval S]``.

Module map: ``stepper`` (step-level engine model), ``situations`` (engines, traffic, delivery
settings), ``delivery`` (engine -> proxy), ``pages`` (/metrics text per engine family),
``generate`` (scrapes, records, truth), ``baseline`` (the README-table rule baseline).
"""
