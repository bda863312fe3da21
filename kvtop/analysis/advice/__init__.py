"""The prescribing half of the analysis: from attributed stalls and measured inputs to a verdict.

``diagnosis`` weighs the causes, ``advisor`` picks the action, the cost model (``costmodel``,
``kvbytes``, ``link``, ``swapimpl``, ``capacity``, ``chunking``) prices swap against recompute and
sizes admission and chunking; ``scenario`` runs the same advice on a what-if file (``kvtop advise``).
"""
