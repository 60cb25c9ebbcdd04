"""memento.diffrax.CheckpointAdjoint against Diffrax's own adjoints, in float64."""

import subprocess
import sys

import numpy as np
import pytest

diffrax = pytest.importorskip("diffrax")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from memento.diffrax import CheckpointAdjoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("x64")

T1 = 4.0
RCA = diffrax.RecursiveCheckpointAdjoint


def field(t, y, a):
    """A damped Duffing oscillator, forced in time: y = (position, velocity)."""
    x, v = y
    return jnp.stack([v, -a[0] * x - a[1] * v - a[2] * x**3 + 0.3 * jnp.cos(t)])


Y0 = np.array([1.0, -0.5])
ARGS = np.array([1.2, 0.15, 0.4])


def solve(y0, a, adjoint, *, solver=None, saveat=None, controller=None, dt0=0.02, **kw):
    return diffrax.diffeqsolve(
        diffrax.ODETerm(field),
        solver or diffrax.Heun(),
        0.0,
        T1,
        dt0,
        y0,
        a,
        saveat=saveat or diffrax.SaveAt(t1=True),
        stepsize_controller=controller or diffrax.ConstantStepSize(),
        adjoint=adjoint,
        **kw,
    )


def value_and_grads(adjoint, **kw):
    """The loss and its gradient w.r.t. (y0, args), under jit."""

    def loss(y0, a):
        ys = solve(y0, a, adjoint, **kw).ys
        w = jnp.cos(jnp.arange(ys.size, dtype=ys.dtype)).reshape(ys.shape)
        return jnp.sum(w * ys**2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(jnp.asarray(Y0), jnp.asarray(ARGS))


_REFERENCES = {}


def reference(key, compute):
    """Diffrax's own adjoint's result, computed by the first case that needs it and reused
    by the cases (other budgets of memento's) that compare with the same thing."""
    if key not in _REFERENCES:
        _REFERENCES[key] = compute()
    return _REFERENCES[key]


def assert_same(got, want):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("solver", [diffrax.Euler(), diffrax.Heun()], ids=["euler", "heun"])
@pytest.mark.parametrize("memory", [1, 5, "2KiB"])
def test_fixed_step_matches_recursive_checkpoint(solver, memory):
    # 200 steps in 1, 5 or 2 KiB / (state size) slots: recomputation, same gradient.
    got = value_and_grads(CheckpointAdjoint(memory=memory), solver=solver)
    want = reference(("fixed", type(solver)), lambda: value_and_grads(RCA(), solver=solver))
    assert_same(got, want)
    assert np.all(np.isfinite(got[1][1])) and np.any(got[1][1] != 0)


def test_adaptive_tsit5_matches_recursive_checkpoint():
    kw = dict(
        solver=diffrax.Tsit5(),
        controller=diffrax.PIDController(rtol=1e-8, atol=1e-8, pcoeff=0.3, icoeff=0.4),
        dt0=0.1,
    )
    sol = solve(jnp.asarray(Y0), jnp.asarray(ARGS), CheckpointAdjoint(memory=6), **kw)
    assert int(sol.stats["num_steps"]) > 30  # many more steps than slots, some rejected
    assert int(sol.stats["num_rejected_steps"]) > 0
    assert_same(value_and_grads(CheckpointAdjoint(memory=6), **kw), value_and_grads(RCA(), **kw))


SAVE_TS = np.linspace(0.0, T1, 200)


@pytest.mark.parametrize("memory", [1, 3, None])
def test_saveat_ts_matches_recursive_checkpoint(memory):
    # 200 save times over 200 steps of Heun (about one a step), and adaptive Tsit5
    # (several a step, none in others): Diffrax's save loop, nested in the step loop,
    # writes the outputs in place (memento.while_loop's nested buffer writes).
    saveat = diffrax.SaveAt(ts=SAVE_TS)
    adj = CheckpointAdjoint(memory=memory)
    want = reference("ts-heun", lambda: value_and_grads(RCA(), saveat=saveat))
    assert_same(value_and_grads(adj, saveat=saveat), want)
    kw = dict(solver=diffrax.Tsit5(), controller=diffrax.PIDController(1e-6, 1e-6))
    got = value_and_grads(adj, saveat=saveat, **kw)
    assert_same(got, reference("ts-tsit5", lambda: value_and_grads(RCA(), saveat=saveat, **kw)))


@pytest.mark.parametrize(
    "ts, dt0",
    [(SAVE_TS[77:78], 0.05), (SAVE_TS, 0.2), (np.linspace(0.0, T1, 201), 0.02)],
    ids=["one-save", "10-saves-a-step", "a-save-at-every-step"],
)
def test_saveat_ts_extremes_match_recursive_checkpoint(ts, dt0):
    saveat = diffrax.SaveAt(ts=ts)
    got = value_and_grads(CheckpointAdjoint(memory=2), saveat=saveat, dt0=dt0)
    assert_same(got, value_and_grads(RCA(), saveat=saveat, dt0=dt0))
    assert np.any(got[1][0] != 0)


ADAPTIVE = dict(
    solver=diffrax.Tsit5(),
    controller=diffrax.PIDController(rtol=1e-8, atol=1e-8, pcoeff=0.3, icoeff=0.4),
    dt0=0.1,
    max_steps=512,
)


def dense_loss(adjoint, saveat, **kw):
    """Outputs (unused rows are inf, set to 0) and, with dense=True, the interpolation at
    off-step times: the value, the gradient, and the solution's ts and ys."""

    def loss(y0, a):
        sol = solve(y0, a, adjoint, saveat=saveat, **kw)
        ys = [jnp.where(jnp.isfinite(y), y, 0.0) for y in jax.tree_util.tree_leaves(sol.ys)]
        out = sum(jnp.sum(jnp.cos(jnp.arange(y.size)).reshape(y.shape) * y**2) for y in ys)
        if saveat.dense:
            out = out + jnp.sum(jax.vmap(sol.evaluate)(jnp.linspace(0.01, T1 - 0.01, 37)) ** 2)
        return out, (sol.ts, sol.ys)

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    return f(jnp.asarray(Y0), jnp.asarray(ARGS))


_SAVEATS = {
    "steps": lambda: diffrax.SaveAt(steps=True),
    "dense": lambda: diffrax.SaveAt(dense=True),
    "steps+dense+ts+t0": lambda: diffrax.SaveAt(t0=True, ts=SAVE_TS[::9], steps=True, dense=True),
    "every-3rd-step": lambda: diffrax.SaveAt(
        subs=[diffrax.SubSaveAt(steps=3), diffrax.SubSaveAt(ts=SAVE_TS[::5])]
    ),
}
# Steps alone and dense alone at one slot; at 4 slots and None the combined SaveAt writes
# the same two buffers (and ts and t0 beside them).
_SAVEAT_CASES = [
    (name, memory)
    for name in _SAVEATS
    for memory in (1, 4, None)
    if memory == 1 or name not in ("steps", "dense")
]


@pytest.mark.parametrize("name,memory", _SAVEAT_CASES, ids=str)
def test_saveat_steps_and_dense_match_recursive_checkpoint(name, memory):
    # Written on accepted steps only (conditional buffer writes): adaptive Tsit5 rejects
    # some steps, so a rejected step's write must leave the buffer and its cotangent.
    # The SaveAt is made under x64 (float64 save times). With float32 ts next to a
    # SubSaveAt(steps=3), the gradient differs from Diffrax's by 1e-8 relative at every
    # memory (memory=None too), an open question (see the notes).
    saveat = _SAVEATS[name]()
    (got, (ts, ys)), grads = dense_loss(CheckpointAdjoint(memory=memory), saveat, **ADAPTIVE)
    (want, (ts_r, ys_r)), grads_r = reference(
        ("saveat", name), lambda: dense_loss(RCA(), saveat, **ADAPTIVE)
    )
    # The same outputs, unused rows (inf) included.
    for g, w in zip(jax.tree_util.tree_leaves((ts, ys)), jax.tree_util.tree_leaves((ts_r, ys_r))):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # Dense interpolation sums many terms: 1 slot recomputes steps in another order than
    # Diffrax's checkpoints do (measured 2e-10 relative apart).
    for g, w in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads_r)):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)
    sol = solve(jnp.asarray(Y0), jnp.asarray(ARGS), RCA(), saveat=saveat, **ADAPTIVE)
    assert int(sol.stats["num_rejected_steps"]) > 0


def test_saveat_steps_fixed_step_and_vmap():
    # Fixed steps (every write taken), and vmap over initial conditions with adaptive
    # steps: each member writes on its own accepted steps.
    saveat = diffrax.SaveAt(steps=True, dense=True)
    assert_same(dense_loss(CheckpointAdjoint(memory=5), saveat), dense_loss(RCA(), saveat))
    y0s = jnp.asarray(Y0) * jnp.array([[1.0], [0.3], [2.0]])

    def grads(adjoint):
        def loss(y0):
            sol = solve(y0, jnp.asarray(ARGS), adjoint, saveat=saveat, **ADAPTIVE)
            ys = jnp.where(jnp.isfinite(sol.ys), sol.ys, 0.0)
            return jnp.sum(ys**2) + jnp.sum(sol.evaluate(1.234) ** 2)

        return jax.jit(jax.vmap(jax.grad(loss)))(y0s)

    assert_same(grads(CheckpointAdjoint(memory=3)), grads(RCA()))


def test_saveat_subsaveat_tree_and_fn_matches_recursive_checkpoint():
    # Two outputs (a tree of SubSaveAt), one through fn, and t0/t1 saves around the loop.
    saveat = diffrax.SaveAt(
        subs=(
            diffrax.SubSaveAt(ts=SAVE_TS[::7], fn=lambda t, y, a: jnp.sin(y[0]) * y[1]),
            diffrax.SubSaveAt(t0=True, t1=True, ts=SAVE_TS[3:50]),
        )
    )

    def loss(adjoint):
        def f(y0, a):
            ys = solve(y0, a, adjoint, saveat=saveat).ys
            return jnp.sum(ys[0] ** 2) + jnp.sum(jnp.cos(ys[1]))

        return jax.jit(jax.grad(f, argnums=(0, 1)))(jnp.asarray(Y0), jnp.asarray(ARGS))

    assert_same(loss(CheckpointAdjoint(memory=4)), loss(RCA()))


def test_saves_per_step_is_deprecated():
    # It bounded a per-step log of saves; the save loop now writes in place, so it has no
    # effect: a step passing more times than it says (10 at dt0 = 0.2) is exact.
    with pytest.warns(DeprecationWarning, match=r"saves_per_step is deprecated"):
        adj = CheckpointAdjoint(memory=4, saves_per_step=2)
    saveat = diffrax.SaveAt(ts=SAVE_TS)
    got = value_and_grads(adj, saveat=saveat, dt0=0.2)
    assert_same(got, value_and_grads(RCA(), saveat=saveat, dt0=0.2))


@pytest.mark.parametrize("meter", [diffrax.TextProgressMeter, diffrax.TqdmProgressMeter])
def test_progress_meter_gradient_matches_recursive_checkpoint(meter, capsys):
    # The meter reads the loop's integer step count through Equinox's unvmap_max, which
    # has no JVP rule: the count must come out of the loop with no tangent.
    if meter is diffrax.TqdmProgressMeter:
        pytest.importorskip("tqdm")
    kw = dict(
        solver=diffrax.Tsit5(),
        controller=diffrax.PIDController(1e-7, 1e-7),
        saveat=diffrax.SaveAt(ts=SAVE_TS[::20]),
        progress_meter=meter(),
    )
    assert_same(value_and_grads(CheckpointAdjoint(memory=4), **kw), value_and_grads(RCA(), **kw))


def test_max_steps_none():
    # Unbounded: memento's online policy in 8 slots; Diffrax needs checkpoints= for it.
    kw = dict(solver=diffrax.Tsit5(), controller=diffrax.PIDController(1e-7, 1e-7), dt0=0.1)
    got = value_and_grads(CheckpointAdjoint(memory=8), max_steps=None, **kw)
    assert_same(got, value_and_grads(RCA(checkpoints=8), max_steps=None, **kw))
    assert_same(got, value_and_grads(CheckpointAdjoint(memory=8), max_steps=4096, **kw))
    with pytest.raises(ValueError, match=r"CheckpointAdjoint: memory=None .* max_steps"):
        value_and_grads(CheckpointAdjoint(memory=None), max_steps=None, **kw)
    # memory=None with a bound keeps every state (max_steps + 1 slots).
    assert_same(value_and_grads(CheckpointAdjoint(memory=None), max_steps=400, **kw), got)


def test_max_steps_reached_is_reported():
    sol = solve(
        jnp.asarray(Y0), jnp.asarray(ARGS), CheckpointAdjoint(memory=4), max_steps=50, throw=False
    )
    assert sol.result == diffrax.RESULTS.max_steps_reached


def test_vmap_over_initial_conditions():
    # Adaptive steps: each member takes its own number of steps.
    y0s = jnp.asarray(Y0) * jnp.array([[1.0], [0.3], [2.0]])
    saveat = diffrax.SaveAt(ts=SAVE_TS[::10])

    def grads(adjoint):
        def loss(y0, a):
            kw = dict(solver=diffrax.Tsit5(), controller=diffrax.PIDController(1e-7, 1e-7))
            sol = solve(y0, a, adjoint, saveat=saveat, **kw)
            return jnp.sum(sol.ys**2), sol.stats["num_steps"]

        g = jax.grad(loss, argnums=(0, 1), has_aux=True)
        return jax.jit(jax.vmap(g, in_axes=(0, None)))(y0s, jnp.asarray(ARGS))

    got, steps = grads(CheckpointAdjoint(memory=5))
    want, steps_rca = grads(RCA())
    assert len(set(np.asarray(steps).tolist())) > 1  # the batch members differ in steps
    np.testing.assert_array_equal(steps, steps_rca)
    assert_same(got, want)


def test_event_matches_recursive_checkpoint():
    # A terminating event (the position crosses 0.2), located by a root find after the loop.
    event = diffrax.Event(lambda t, y, a, **kw: y[0] - 0.2, root_finder=None)
    kw = dict(solver=diffrax.Tsit5(), controller=diffrax.PIDController(1e-8, 1e-8), event=event)
    got = value_and_grads(CheckpointAdjoint(memory=4), **kw)
    assert_same(got, value_and_grads(RCA(), **kw))
    sol = solve(jnp.asarray(Y0), jnp.asarray(ARGS), CheckpointAdjoint(memory=4), **kw)
    assert sol.result == diffrax.RESULTS.event_occurred


def temp_bytes(adjoint, saveat, size):
    """Compiled temporary memory of jit(grad) for a state of 2 x size (Heun, 200 steps)."""

    def loss(y0, a):
        return jnp.sum(solve(y0, a, adjoint, saveat=saveat, max_steps=200).ys ** 2)

    y0 = jnp.ones((2, size))
    f = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return f.lower(y0, jnp.asarray(ARGS)).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("size", [1, 16])
def test_memory_with_200_save_times_against_recursive_checkpoint(size):
    saveat = diffrax.SaveAt(ts=SAVE_TS)
    outputs = len(SAVE_TS) * 8 * (1 + 2 * size)  # ts and ys, float64
    for slots in (8, 32):
        rca = temp_bytes(RCA(checkpoints=slots), saveat, size)
        ours = temp_bytes(CheckpointAdjoint(memory=slots), saveat, size)
        # The save loop writes the outputs in place, and its backward zeroes a location's
        # cotangent a step after reading it (`_buffer_cts`). Measured at 8 and 32 slots:
        # 0.96x and 0.95x Diffrax's with a 2-state ODE, 1.01x and 0.99x with 32 states
        # (1.44x and 1.36x when the location was zeroed in the step that read it: XLA
        # copied the outputs' cotangent; 1.4 to 2 more with the per-step log before).
        assert ours <= 1.1 * rca, (slots, ours, rca, outputs)


def test_memory_grows_with_budget_not_steps():
    saveat = diffrax.SaveAt(t1=True)

    def temp(adjoint, steps):
        def loss(y0):
            kw = dict(dt0=T1 / steps, max_steps=steps, saveat=saveat)
            return jnp.sum(solve(y0, jnp.asarray(ARGS), adjoint, **kw).ys ** 2)

        f = jax.jit(jax.grad(loss))
        return f.lower(jnp.ones((2, 64))).compile().memory_analysis().temp_size_in_bytes

    small, large = temp(CheckpointAdjoint(memory=8), 100), temp(CheckpointAdjoint(memory=8), 4000)
    assert large == small
    assert temp(CheckpointAdjoint(memory=32), 4000) > large + 20 * 2 * 64 * 8


def test_errors():
    with pytest.raises(ValueError, match=r"CheckpointAdjoint: memory=0 slots is too small"):
        CheckpointAdjoint(memory=0)
    with pytest.raises(ValueError, match=r"CheckpointAdjoint: cannot read memory='lots'"):
        CheckpointAdjoint(memory="lots")
    with pytest.raises(ValueError, match=r"saves_per_step must be None or an int >= 1"):
        CheckpointAdjoint(memory=4, saves_per_step=0)
    with pytest.raises(TypeError):
        CheckpointAdjoint(4, 2)  # saves_per_step is keyword-only
    y0, a = jnp.asarray(Y0), jnp.asarray(ARGS)
    bm = diffrax.UnsafeBrownianPath(shape=(), key=jax.random.key(0))
    terms = diffrax.MultiTerm(
        diffrax.ODETerm(field), diffrax.ControlTerm(lambda t, y, a: 0.1 * y, bm)
    )
    with pytest.raises(ValueError, match=r"CheckpointAdjoint: an UnsafeBrownianPath"):
        diffrax.diffeqsolve(
            terms, diffrax.Euler(), 0.0, 1.0, 0.1, y0, a, adjoint=CheckpointAdjoint(memory=4)
        )


SOME_TS = np.linspace(0.3, 3.9, 7)  # NumPy: float64 in the test (SaveAt converts)


def ys_of(adjoint, **kw):
    return lambda y0, a: solve(y0, a, adjoint, saveat=diffrax.SaveAt(ts=SOME_TS), **kw).ys


@pytest.mark.parametrize(
    "solver, controller",
    [
        (diffrax.Euler(), None),
        (diffrax.Heun(scan_kind="bounded"), None),
        (diffrax.Heun(), None),
        (diffrax.Tsit5(), diffrax.PIDController(rtol=1e-6, atol=1e-6)),
    ],
    ids=["euler", "heun-bounded", "heun", "tsit5-adaptive"],
)
def test_jacfwd_matches_direct_adjoint(solver, controller):
    # Forward mode evaluates jvp of the step loop, the save loop's writes included.
    kw = dict(solver=solver, controller=controller, dt0=0.05, max_steps=256)
    jacfwd = lambda adjoint: jax.jit(jax.jacfwd(ys_of(adjoint, **kw), (0, 1)))(
        jnp.asarray(Y0), jnp.asarray(ARGS)
    )
    assert_same(jacfwd(CheckpointAdjoint(memory=3)), jacfwd(diffrax.DirectAdjoint()))


@pytest.mark.parametrize("solver", [diffrax.Euler(), diffrax.Tsit5()], ids=["euler", "tsit5"])
def test_second_derivatives_match_direct_adjoint(solver):
    # jax.hessian and grad of grad run the loop of the step's JVP (the save loop's
    # included) as a budgeted memento.while_loop; DirectAdjoint's are unbudgeted.
    def second(adjoint):
        ys = ys_of(adjoint, solver=solver, dt0=0.05, max_steps=256)
        loss = lambda y0, a: jnp.sum(jnp.sin(ys(y0, a)))

        @jax.jit
        def run(y0, a):
            return [
                jax.hessian(loss, 1)(y0, a),
                jax.grad(lambda y: jnp.sum(jax.grad(loss, 1)(y, a) ** 2))(y0),
            ]

        return run(jnp.asarray(Y0), jnp.asarray(ARGS))

    assert_same(second(CheckpointAdjoint(memory=3)), second(diffrax.DirectAdjoint()))


def test_the_gradient_runs_the_solver_as_given():
    # A Runge-Kutta solver's default stage loop (a jax.custom_vjp) runs the steps and the
    # gradient; the stage loop JAX differentiates in forward mode is only for the other
    # derivatives: the gradient's program is that of the solver built with it explicitly.
    def temp(solver):
        loss = lambda y0: jnp.sum(
            solve(y0, jnp.asarray(ARGS), CheckpointAdjoint(4), solver=solver).ys
        )
        compiled = jax.jit(jax.grad(loss)).lower(jnp.asarray(Y0)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp(diffrax.Heun()) == temp(diffrax.Heun(scan_kind="checkpointed"))


_TYPECHECKED = """
import sys
import beartype, jaxtyping
# As Diffrax's own test suite: jaxtyping's import hook with beartype on every call.
with jaxtyping.install_import_hook(
    "diffrax", "beartype.beartype(conf=beartype.BeartypeConf(strategy=beartype.BeartypeStrategy.On))"
):
    import diffrax
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_enable_x64", True)
from memento.diffrax import CheckpointAdjoint

def grads(adjoint, saveat):
    def loss(y0):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, a: jnp.stack([y[1], -y[0] - 0.1 * y[1] ** 3])),
            diffrax.Tsit5(), 0.0, 3.0, 0.1, y0, saveat=saveat,
            stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-6),
            adjoint=adjoint, max_steps=256,
        )
        return sum(jnp.sum(jnp.where(jnp.isfinite(y), y, 0.0) ** 2) for y in jax.tree_util.tree_leaves(sol.ys))
    return jax.jit(jax.value_and_grad(loss))(jnp.array([1.0, 0.5]))

for saveat in SAVEATS:
    got = grads(CheckpointAdjoint(memory=4), saveat)
    want = grads(diffrax.RecursiveCheckpointAdjoint(), saveat)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-10)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-10, atol=1e-12)
print("checked", len(SAVEATS))
"""


def test_under_diffrax_runtime_type_checks():
    # Diffrax's SaveState annotates its outputs as MaybeBuffer[Real[Array, "times"]]; the
    # write-only stand-ins must pass (they failed with a TypeCheckError before). The hook
    # works at import time, hence a fresh interpreter: one for every SaveAt (save times,
    # t0 and t1, steps, dense), as importing Diffrax under the hook is most of its cost.
    pytest.importorskip("beartype")
    saveats = (
        "[diffrax.SaveAt(ts=jnp.linspace(0.0, 3.0, 7)), diffrax.SaveAt(t0=True, t1=True),"
        " diffrax.SaveAt(steps=True), diffrax.SaveAt(dense=True, t1=True)]"
    )
    code = _TYPECHECKED.replace("SAVEATS", saveats)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "checked 4" in out.stdout


def test_import_memento_stays_free_of_diffrax_and_hints_without_it():
    code = (
        "import sys; sys.modules['diffrax'] = None\n"
        "import memento\n"
        "assert 'jax' not in sys.modules and 'equinox' not in sys.modules\n"
        "try:\n"
        "    memento.diffrax\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 'pip install "memento-jax[diffrax]"' in out.stdout
