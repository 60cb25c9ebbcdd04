"""What the command line runs besides the planner: the demo and the figures.

Not library code: these modules print, time and draw. ``memento demo``, ``memento curves``
and ``memento plan --plot`` (see `memento.cli`) use them, and so do a few scripts in
``benchmarks/``. Dependencies point one way: apps -> loops -> planning; nothing in the
library imports this package. The benchmarks' models and tasks are not in the package:
``benchmarks/memento_bench``.

- `memento.apps.demo`: the LSTM of ``memento demo`` and ``benchmarks/rnn.py``.
- `memento.apps.plotting`: the paper's figures (NumPy data, matplotlib drawing).

Importing this package imports nothing; each module loads what it needs (jax for the
demo; ``plotting`` needs only NumPy until it draws).
"""
