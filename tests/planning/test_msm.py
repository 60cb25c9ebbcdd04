"""The column-wise MSM table against the O(t^2 m) one: same C, valid choices, replays."""

import functools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from memento.planning import _dp, _msm, _reference as ref, plan

PAIRS = [(a, b) for a in range(1, 7) for b in range(1, a + 1)]


def _choice_costs(c, kind, split, alpha, beta):
    """The cost of each cell's recorded choice (kind, y), from c itself; [t >= 2, m >= 2]."""
    T, M = c.shape[0] - 1, c.shape[1] - 1
    t = np.arange(2, T + 1)[:, None]
    m = np.arange(2, M + 1)[None, :]
    y = split[2:, 2:].astype(np.int64)
    internal = kind[2:, 2:].astype(np.int64)
    assert np.all((y >= 1) & (y <= t - 1 + internal))  # a hidden push leaves a right part
    right = m - np.where(internal == 0, 1, np.where(y == 1, beta, alpha))
    right_cost = np.where(right >= 1, c[t - y, np.maximum(right, 0)], _msm._BIG)
    return y + c[y - internal, m] + right_cost


def _assert_exact(num_steps, memory, alpha, beta, exact_rows):
    full, _, _ = _msm.msm_tables_full(num_steps, memory, alpha, beta)
    c, kind, split = _msm.msm_tables(num_steps, memory, alpha, beta, exact_rows=exact_rows)
    assert np.array_equal(c, full), np.argwhere(c != full)[:5]
    assert np.array_equal(_choice_costs(c, kind, split, alpha, beta), c[2:, 2:])


@pytest.mark.parametrize("alpha, beta", PAIRS)
def test_columns_equal_the_full_table(alpha, beta):
    # Small exact_rows: almost every row comes from the blocks and the certificate.
    for exact_rows in (2, 5):
        _assert_exact(400, 40, alpha, beta, exact_rows)
    _assert_exact(150, 13, alpha, beta, 3)


@settings(max_examples=40, deadline=None)
@given(
    t=st.integers(2, 600),
    m=st.integers(2, 50),
    pair=st.sampled_from(PAIRS),
    exact_rows=st.integers(2, 40),
)
def test_random_columns_equal_the_full_table(t, m, pair, exact_rows):
    _assert_exact(t, m, *pair, exact_rows)


def test_full_table_is_the_textbook_oracle():
    for alpha, beta in [(2, 1), (3, 3), (5, 2)]:
        table = ref.msm_table(40, 12, alpha, beta)
        c, _, _ = _msm.msm_tables_full(40, 12, alpha, beta)
        assert all(c[t, m] == table[t][m] for t in range(1, 41) for m in range(1, 13))


def test_blocks_stretched_too_far_are_repaired(monkeypatch):
    # Without the growth limit the first blocks overshoot (values too high), the
    # certificate flags them, and the column is refilled: still exact.
    repairs = []
    row = _msm._row

    def counted(cx, t, lo, hi, *args):
        if lo == hi:  # one column: a repair (the full table scans columns 2..30)
            repairs.append(t)
        return row(cx, t, lo, hi, *args)

    monkeypatch.setattr(_msm, "_GROWTH", 10**9)
    monkeypatch.setattr(_msm, "_row", counted)
    _assert_exact(1500, 30, 5, 2, 8)
    assert len(repairs) >= 5


def test_certificate_rejects_a_suboptimal_choice():
    T, m, alpha, beta = 300, 12, 4, 4
    c, kind, split = _msm.msm_tables(T, m, alpha, beta, exact_rows=4)
    pad = alpha
    cx = np.full((T + 1, m + 1 + pad), _msm._BIG, dtype=np.int64)
    cx[:, pad:] = c
    hulls = {}
    for k in range(1, m):
        hx, hy = _msm._hull(cx[:, pad + k], 1, T)
        hulls[k] = (_msm._Piecewise(hx, hy), _msm._Piecewise(*_msm._hull(cx[:, pad + k], 0, T)))
    column = _msm._Column(cx, kind, split, m, pad, alpha, beta, hulls)
    column.hx, column.hy = _msm._hull(column.c, 1, T)
    assert len(column.failures(5)) == 0
    # A consistent but worse choice at t = 200 (passes (a)): the lower bound (b) flags it.
    t = 200
    y = 1 + int(np.argmax(np.arange(1, t) + c[1:t, m] + c[t - 1 : 0 : -1, m - 1] > c[t, m]))
    column.c[t] = y + c[y, m] + c[t - y, m - 1]
    kind[t, m], split[t, m] = _msm._HIDDEN, y
    assert 200 in column.failures(5).tolist()
    # A value that its choice does not attain fails (a).
    column.c[t] = c[t, m] - 1
    kind[t, m], split[t, m] = _msm._HIDDEN, y
    assert 200 in column.failures(5).tolist()


@pytest.mark.parametrize("alpha, beta", [(5, 5), (5, 2), (2, 2), (3, 1)])
def test_schedules_from_the_columns_replay(alpha, beta, monkeypatch):
    monkeypatch.setattr(_dp, "msm_tables", functools.partial(_msm.msm_tables, exact_rows=2))
    full, _, _ = _msm.msm_tables_full(60, 14, alpha, beta)
    for t in range(1, 61, 5):
        for m in range(1, 15):
            s = plan(t, m, policy="msm", alpha=alpha, beta=beta)
            result = s.simulate()
            assert s.cost == result.forward_evaluations == full[t, m]
            assert result.peak_memory <= m


def test_long_plan_replays():
    # t = 3000 takes the column-wise table by default.
    c, _, _ = _msm.msm_tables_full(3000, 25, 5, 5)
    s = plan(3000, 25, policy="msm", alpha=5)
    assert s.cost == s.simulate().forward_evaluations == c[3000, 25]


def test_estimate_picks_the_faster_table():
    assert _msm.msm_estimate_s(10_000, 200, 5, 5) < 1.0
    full, columns = _msm._estimates_s(100, 200, 5, 5)
    assert _msm.msm_estimate_s(100, 200, 5, 5) == full < columns
    assert _msm.msm_estimate_s(100, 200, 1, 1) == 0.0
