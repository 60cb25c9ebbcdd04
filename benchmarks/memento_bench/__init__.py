"""Models, tasks and harnesses of the benchmarks; not part of the memento distribution.

Importable with ``benchmarks/`` on ``sys.path`` (the scripts in ``benchmarks/`` run with
it there; the examples and the tests add it):

- `memento_bench.transformer`: the small plain-JAX decoder-only transformer.
- `memento_bench.tasks`: MixFlow-MG's three bilevel tasks on it.
- `memento_bench.toy`: MixFlow-MG's toy meta-learning task (Eq. 9).
- `memento_bench.metagrad`: the meta-gradient benchmark of ``benchmarks/metagrad.py``.
- `memento_bench.hlo`: which collectives run inside a compiled program's loops.
"""
