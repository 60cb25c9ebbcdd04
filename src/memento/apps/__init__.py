"""Applications built on memento: the demo, the benchmarks' tasks and the figures.

Not library code: these modules print, time and draw. ``memento demo``, ``memento bench``,
``memento curves`` and ``memento plan --plot`` (see `memento.cli`), the scripts in
``benchmarks/`` and the examples in ``examples/`` use them. Dependencies point one way:
apps -> meta -> loops -> planning; nothing in the library imports this package.

- `memento.apps.demo`: the LSTM of ``memento demo`` and ``benchmarks/rnn.py``.
- `memento.apps.tasks`: MixFlow-MG's three bilevel tasks on the small transformer.
- `memento.apps.toy`: MixFlow-MG's toy meta-learning task (Eq. 9).
- `memento.apps.bench`: the meta-gradient benchmark of ``memento bench metagrad``.
- `memento.apps.plotting`: the paper's figures (NumPy data, matplotlib drawing).

Importing this package imports nothing; each module loads what it needs (jax for all but
``plotting``, which needs only NumPy until it draws).
"""
