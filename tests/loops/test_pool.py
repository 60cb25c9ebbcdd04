"""The byte pool: exact round trips for every dtype, stack offsets within the budget."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memento
from memento.loops import _pool


def _round_trip(leaves, expected_word):
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    word = _pool.word_bytes(avals)
    assert word == expected_word
    size = sum(x.size * x.dtype.itemsize for x in leaves)
    unit = _pool.unit_words(16, word)  # a 16-byte carry
    units = -(-size // (unit * word))
    pool = _pool.allocate(2 + units, unit, word)
    assert pool.dtype.itemsize == word and pool.shape == ((2 + units) * unit,)
    pool = _pool.write(pool, 2, leaves, unit)
    for a, b in zip(leaves, _pool.read(pool, 2, avals, unit)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a masked write changes nothing
    same = _pool.write(pool, 2, [x * 0 for x in leaves[:1]], unit, when=False)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(pool))


def test_write_read_round_trip_every_dtype():
    with jax.enable_x64(True):
        mixed = [
            jnp.arange(6, dtype=jnp.float64).reshape(2, 3) / 7,
            jnp.array([1.5, -2.25], jnp.bfloat16),
            jnp.array([[1, -2]], jnp.int32),
            jnp.array([True, False, True]),
            jnp.array(3, jnp.uint8),
            jnp.array([0.1], jnp.float32),
        ]
        _round_trip(mixed, 1)  # bytes
        _round_trip([mixed[0], mixed[2], mixed[5]], 4)  # float64 as two words
        _round_trip([mixed[1], mixed[5]], 2)
    # The common case: float32 leaves go in as uint32 of the same shape.
    _round_trip([jnp.arange(12, dtype=jnp.float32).reshape(3, 4) / 3, jnp.ones(5)], 4)


def test_empty_carry_still_has_a_unit():
    assert _pool.unit_words(0, 4) == 1
    assert _pool.unit_words(6, 4) == 2


@pytest.mark.parametrize("policy,alpha", [("hsm", None), ("ism", 3), ("msm", 3), ("msm", 8)])
@pytest.mark.parametrize("steps,memory", [(1, 8), (40, 8), (97, 24), (300, 60)])
def test_stack_offsets_fit_the_budget(policy, alpha, steps, memory):
    schedule = memento.plan(steps, memory, policy=policy, alpha=alpha)
    rows, units = _pool.stack_offsets(schedule, alpha or 1)
    # h_0 is the caller's input, not in the pool; HSM and MSM count it in the budget.
    assert units <= memory - int(schedule.counts_initial)
    assert not np.isin(rows[:, 0], (memento.Op.FREE_HIDDEN, memento.Op.FREE_INTERNAL)).any()


def test_out_of_stack_order_is_refused():
    Op = memento.Op
    rows = [
        (Op.SAVE_HIDDEN, 0, 0), (Op.ADVANCE, 1, 0), (Op.SAVE_HIDDEN, 1, 1),
        (Op.FREE_HIDDEN, 0, 0), (Op.ADVANCE, 1, 1), (Op.BACKWARD_FUSED, 0, 2),
    ]  # fmt: skip
    schedule = memento.Schedule(3, 9, "x", 0, np.array(rows))
    with pytest.raises(ValueError, match="out of stack order"):
        _pool.stack_offsets(schedule, 1)
