"""One process of the 2-process test (``tests/test_multihost.py``); not a test module.

``python _multihost_worker.py PROCESS_ID NUM_PROCESSES PORT``, with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``: joins the others on loopback
(gloo collectives on CPU), then compares gradients of `memento.scan` and
`memento.while_loop` with ``lax.scan``'s (or the unrolled loop's) over the global mesh
of every process's devices. Each comparison is reduced inside the program to one
replicated number, printed as ``CHECK <name> <max abs error>``; the parent asserts.
"""

import functools
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_enable_x64", True)
process_id, num_processes, port = (int(a) for a in sys.argv[1:4])
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=60,
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import memento  # noqa: E402

N = jax.device_count()  # every process's devices
T, B, H = 12, 2 * N, 8
rng = np.random.default_rng(0)  # the same data in every process
W = rng.normal(size=(H, H)) * 0.4
H0 = rng.normal(size=(B, H)) * 0.5
XS = rng.normal(size=(T, B, H))


def check(name, got, want):
    err = jax.jit(
        lambda a, b: jnp.max(jnp.stack([jnp.max(jnp.abs(x - y)) for x, y in zip(a, b)])),
        out_shardings=NamedSharding(MESH, P()),
    )(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))
    print(f"CHECK {name} {float(err):.3e}", flush=True)


def scans():
    def rec(f, init, xs, memory):  # HSM as the device recursion
        return memento.scan(f, init, xs, memory=memory, policy="hsm", executor="recursion")

    yield "hsm", lambda f, i, x: memento.scan(f, i, x, memory=4, policy="hsm")
    yield "ism", lambda f, i, x: memento.scan(f, i, x, memory=40, policy="ism")
    yield "hsm-rec", functools.partial(rec, memory=4)


def loss(w, h0, xs, scan):
    def cell(h, x):
        h = jnp.tanh(h @ w + x)
        return h, jnp.sum(h**2, axis=1)

    h, ys = scan(cell, h0, xs)
    return jnp.sum(ys * jnp.arange(1, T + 1)[:, None]) + jnp.sum(jnp.sin(h))


def while_loss(w, h0, xs, loop):
    def body(s):
        i, h = s
        return i + 1, jnp.tanh(h @ w + xs[0])

    return jnp.sum(loop(lambda s: s[0] < 7, body, (0, h0))[1] ** 2)


def unrolled(cond, body, s, steps):
    for _ in range(steps):
        s = jax.tree_util.tree_map(lambda a, b, s=s: jnp.where(cond(s), a, b), body(s), s)
    return s


def put(x, spec):
    return jax.device_put(x, NamedSharding(MESH, spec))


# Data parallel: the batch over every device of both processes.
MESH = jax.make_mesh((N,), ("b",), axis_types=(AxisType.Auto,))
w, h0, xs = put(W, P()), put(H0, P("b")), put(XS, P(None, "b"))
grad = jax.jit(jax.grad(loss, (0, 1, 2)), static_argnums=3)
want = grad(w, h0, xs, lax.scan)
for name, scan in scans():
    check(f"data-{name}", grad(w, h0, xs, scan), want)
wgrad = jax.jit(jax.grad(while_loss, (0, 1)), static_argnums=3)
ours = functools.partial(memento.while_loop, memory=3, max_steps=10)
check("data-while", wgrad(w, h0, xs, ours), wgrad(w, h0, xs, functools.partial(unrolled, steps=7)))

# Model parallel: the hidden dimension over the devices of each process, the batch over
# the processes.
MESH = jax.make_mesh(
    (num_processes, N // num_processes), ("b", "m"), axis_types=(AxisType.Auto,) * 2
)
w, h0, xs = put(W, P(None, "m")), put(H0, P("b", "m")), put(XS, P(None, "b", "m"))
want = grad(w, h0, xs, lax.scan)
for name, scan in scans():
    check(f"model-{name}", grad(w, h0, xs, scan), want)
check("model-while", wgrad(w, h0, xs, ours), wgrad(w, h0, xs, functools.partial(unrolled, steps=7)))

# shard_map(check_vma=True), each device stopping at its own step, the weight read
# unvaried: its psum must run once, after the backward loop, or the devices deadlock.
MESH = jax.make_mesh((N,), ("b",), axis_types=(AxisType.Auto,))
w, h0 = put(W, P()), put(H0, P("b"))
n = put(np.arange(N) % 5 + 2, P("b"))  # 2..6 steps, differing across the processes


def per_device(loop):
    def local(w, h0, n):
        def body(s):
            i, h = s
            return i + 1, jnp.tanh(h @ w)

        _, h = loop(lambda s: s[0] < n[0], body, (jnp.int32(0), h0))
        return jnp.sum(h**2)[None]

    f = jax.shard_map(
        local, mesh=MESH, in_specs=(P(), P("b"), P("b")), out_specs=P("b"), check_vma=True
    )
    return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), (0, 1)))(w, h0, n)


check(
    "per-device-while",
    per_device(functools.partial(memento.while_loop, memory=3)),
    per_device(functools.partial(unrolled, steps=6)),
)
jax.distributed.shutdown()
print("DONE", flush=True)
