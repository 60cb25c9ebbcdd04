"""memento at its peers' own bytes: temp memory and time of a long loop's gradient, as ratios.

A JAX user who saves memory in a long loop's gradient writes one of a few idioms. Each
takes some temporary memory when compiled; given that many bytes (``memory=f"{N}B"``),
memento should fit in them and be about as fast. This benchmark measures it, in one
process, on CPU:

- Loss: ``sum(ys) + sum(final carry)``; the gradient is taken with respect to the
  cell's weights, which the step closes over.
- Bodies: ``tanh(W @ h + x)`` with 4 floats, ``tanh(w * h + x)`` with 256, ``tanh(W @ h
  + x)`` with 128, LSTMs of hidden 32 and batch 16, and of hidden 256 and batch 32 (each
  step's output is the mean of the new state squared). Beside them, bodies the headline
  does not use: a GRU of hidden 64 and batch 8 (its weights' cotangents are matrix
  products), a carry of two 64-float leaves one of which no derivative reads, a scalar
  carry, and ``tanh(w * h + x)`` with 4096 floats.
- Peers: ``lax.scan`` (stores everything), ``lax.scan(jax.checkpoint(step))``
  (checkpoint per step), nested sqrt(T) (a ``lax.scan`` over segments, each a
  ``jax.checkpoint``-ed ``lax.scan``; a divisor of T as the segment length where one
  lies within 2x of sqrt(T), a shorter last segment otherwise), a 3-level nest, and
  Equinox's ``equinox.internal.while_loop(kind="checkpointed")`` with as many
  checkpoints as the nested idiom keeps carries (segments plus one segment's steps).
- memento: ``memory`` set to the temp bytes of nested sqrt(T), of checkpoint per step,
  and a quarter of nested sqrt(T)'s; at each, ``executor="auto"`` and every forced
  executor this memento accepts (``"static"``, ``"rows"``, ``"recursion"``; one it does
  not know is recorded as unsupported). A budget memento refuses is recorded with its
  message.
- Memory: ``memory_analysis().temp_size_in_bytes`` of the compiled gradient (exact and
  deterministic). Time: every method compiled and run once first, then the median of
  round-robin rounds (each method once per round, or back to back for ``--min-round-s``
  when faster), ``jax.block_until_ready`` after each.
  A method whose temp bytes are past ``--max-run-bytes`` is compiled but not run.
- ``--first-call``: the first call (trace, plan, compile, run) at T = 10^6 of
  ``lax.scan``, nested sqrt(T), and memento at nested sqrt(T)'s bytes, each with a new
  closure and JAX's and memento's caches cleared (``--first-call-bodies``, default the
  4-float cell: ``lax.scan`` keeps all 10^6 steps' residuals; where they are past
  ``--max-run-bytes`` it is left out, and the times are compared with nested sqrt(T)'s).
  ``--steps ""`` times first calls only.

Every method's gradient is checked against ``lax.scan``'s (float32 tolerances; the first
peer that runs where ``lax.scan`` is past ``--max-run-bytes``) before anything is timed. Targets: at nested sqrt(T)'s and at checkpoint per step's bytes,
temp <= budget * 1.05 + 4 KiB and time <= 1.1x that idiom's; at a quarter of nested
sqrt(T)'s bytes, temp within the same bound and time <= 1.6x nested sqrt(T)'s.

Run:  PYTHONPATH=src python benchmarks/pareto.py [--quick] [--steps 1e4,1e5]
      [--bodies tanh4,elem256,matvec128,lstm32,lstm256,gru64,velocity64,scalar,elem4096,
       rk4mlp,mixed256,counter16,conv8x128,attn32,bigx8,ysbig8,bf16c512,lse48,max32,
       tally256]
      [--executors auto,static,rows,recursion]
      [--rounds 5] [--first-call] [--max-run-bytes 4e9] [--threads one|all] [--out PATH]
      (``--quick``: T = 1000, tanh4 and lstm32, 3 rounds, in place of those flags)
      PYTHONPATH=src python benchmarks/pareto.py --markdown benchmarks/results/pareto.json

Writes JSON (default benchmarks/results/pareto.json) and prints the markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: I001

import numpy as np

DEFAULT_OUT = Path(__file__).parent / "results" / "pareto.json"
EXECUTORS = ("auto", "static", "rows", "recursion")
PEERS = ("lax.scan", "checkpoint per step", "nested sqrt(T)", "nested 3 levels", "equinox")

# Budget name -> (the idiom whose temp bytes set it, their fraction, the idiom times
# are compared with, the time target).
BUDGETS = {
    "nested sqrt(T)": ("nested sqrt(T)", 1.0, "nested sqrt(T)", 1.1),
    "checkpoint per step": ("checkpoint per step", 1.0, "checkpoint per step", 1.1),
    "quarter nested": ("nested sqrt(T)", 0.25, "nested sqrt(T)", 1.6),
}
BYTES_SLACK = (1.05, 4096)  # temp <= budget * 1.05 + 4 KiB
RTOL = 2e-3  # float32 gradients of 10^4+ steps, summed in different orders
# Bodies that compute in bfloat16: memento casts each step's weight cotangent to float32
# before adding it up, lax.scan adds them in bfloat16; each is about 8e-3 from the
# float64 gradient of the cell without the casts (tests/benchmarks/test_pareto.py).
BF16_RTOL = 1.6e-2


# Bodies ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Body:
    """A loop body: ``cell(weights, carry, x) -> (carry, y)`` and how to make its inputs.

    Attributes:
        name: the ``--bodies`` key.
        label: how the tables name it.
        cell: the step, ``y`` a scalar.
        make: ``make(num_steps) -> (weights, init, xs)``.
        rtol: the gradient check's tolerance, relative to the reference's largest entry.
    """

    name: str
    label: str
    cell: Callable
    make: Callable[[int], tuple[Any, Any, Any]]
    rtol: float = RTOL


def _matvec(W, h, x):
    import jax.numpy as jnp

    h = jnp.tanh(W @ h + x)
    return h, jnp.mean(h * h)


def _elementwise(w, h, x):
    import jax.numpy as jnp

    h = jnp.tanh(w * h + x)
    return h, jnp.mean(h * h)


def _tanh_inputs(width: int, matrix: bool):
    import jax
    import jax.numpy as jnp

    def make(num_steps):
        k1, k2 = jax.random.split(jax.random.PRNGKey(0))
        if matrix:
            w = jax.random.normal(k1, (width, width), jnp.float32) * 0.9 / math.sqrt(width)
        else:
            w = 0.9 + 0.1 * jax.random.uniform(k1, (width,), jnp.float32)
        xs = 0.1 * jax.random.normal(k2, (num_steps, width), jnp.float32)
        return w, jnp.full((width,), 0.5, jnp.float32), xs

    return make


def _lstm_inputs(hidden: int, batch: int, features: int = 8):
    import jax
    import jax.numpy as jnp

    def make(num_steps):
        k = jax.random.split(jax.random.PRNGKey(0), 4)
        scale = 1.0 / math.sqrt(hidden)
        params = {
            "W": jax.random.normal(k[0], (features, 4 * hidden), jnp.float32) * scale,
            "U": jax.random.normal(k[1], (hidden, 4 * hidden), jnp.float32) * scale,
            "b": jnp.zeros((4 * hidden,), jnp.float32),
        }
        h0 = 0.1 * jax.random.normal(k[2], (batch, hidden), jnp.float32)
        xs = jax.random.normal(k[3], (num_steps, batch, features), jnp.float32)
        return params, (h0, jnp.zeros_like(h0)), xs

    return make


def _gru(p, h, x):
    import jax
    import jax.numpy as jnp

    z = jax.nn.sigmoid(x @ p["Wz"] + h @ p["Uz"])
    r = jax.nn.sigmoid(x @ p["Wr"] + h @ p["Ur"])
    n = jnp.tanh(x @ p["Wn"] + (r * h) @ p["Un"])
    h = (1 - z) * n + z * h
    return h, jnp.mean(h)


def _gru_inputs(hidden: int, batch: int, features: int = 16):
    import jax

    def make(num_steps):
        k = jax.random.split(jax.random.PRNGKey(1), 7)
        scale = 1.0 / math.sqrt(hidden)
        names = ["Wz", "Uz", "Wr", "Ur", "Wn", "Un"]
        params = {
            n: jax.random.normal(k[i], (features if n[0] == "W" else hidden, hidden)) * scale
            for i, n in enumerate(names)
        }
        xs = jax.random.normal(k[6], (num_steps, batch, features))
        return params, 0.1 * jax.numpy.ones((batch, hidden)), xs

    return make


def _velocity(p, c, x):
    """A state and its velocity: the velocity enters linearly, so no derivative reads it."""
    import jax.numpy as jnp

    v = 0.9 * c["v"] + 0.1 * jnp.tanh(p @ c["h"] + x)
    h = c["h"] + 0.1 * v
    return {"h": h, "v": v}, jnp.sum(h) * 1e-3


def _velocity_inputs(num_steps):
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.PRNGKey(2), 2)
    init = {"h": jnp.zeros(64), "v": jnp.full((64,), 0.1)}
    return (
        jax.random.normal(k[0], (64, 64)) / 8,
        init,
        0.1 * jax.random.normal(k[1], (num_steps, 64)),
    )


def _scalar(p, h, x):
    import jax.numpy as jnp

    h = jnp.tanh(p[0] * h + p[1] * x)
    return h, h


def _scalar_inputs(num_steps):
    import jax
    import jax.numpy as jnp

    xs = jax.random.normal(jax.random.PRNGKey(3), (num_steps,))
    return jnp.array([0.9, 0.5]), jnp.float32(0.3), xs


def _wave_inputs(width: int):
    import jax.numpy as jnp

    def make(num_steps):
        phase = jnp.arange(num_steps)[:, None] * 0.01 + jnp.arange(width)[None] * 0.001
        return jnp.full((width,), 0.9), jnp.zeros(width), 0.1 * jnp.sin(phase)

    return make


def _rk4(p, h, x):
    """One classical Runge-Kutta step of a two-layer field: many internal states per
    carry."""
    import jax.numpy as jnp

    def field(y):
        return jnp.tanh(p["A"] @ jnp.tanh(p["B"] @ y + x))

    dt = 0.05
    k1 = field(h)
    k2 = field(h + dt / 2 * k1)
    k3 = field(h + dt / 2 * k2)
    k4 = field(h + dt * k3)
    h = h + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return h, jnp.sum(h * h)


def _rk4_inputs(num_steps):
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.PRNGKey(5), 3)
    params = {
        "A": jax.random.normal(k[0], (32, 64)) / 8,
        "B": jax.random.normal(k[1], (64, 32)) / 6,
    }
    return params, jnp.full((32,), 0.1), 0.1 * jax.random.normal(k[2], (num_steps, 64))


def _mixed(p, h, x):
    """A matrix product in bfloat16, the rest in float32 (mixed precision)."""
    import jax.numpy as jnp

    z = (p["W"].astype(jnp.bfloat16) @ h.astype(jnp.bfloat16)).astype(jnp.float32)
    h = jnp.tanh(z * p["s"] + x)
    return h, jnp.mean(h)


def _mixed_inputs(num_steps):
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.PRNGKey(6), 2)
    params = {"W": jax.random.normal(k[0], (256, 256)) / 16, "s": jnp.float32(0.9)}
    return params, jnp.zeros(256), 0.1 * jax.random.normal(k[1], (num_steps, 256))


def _counter(p, c, x):
    """An integer step counter beside the state."""
    import jax.numpy as jnp

    i, h = c
    h = jnp.tanh(p @ h + x * jnp.sin(i.astype(jnp.float32) * 0.01))
    return (i + 1, h), h[0]


def _counter_inputs(num_steps):
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.PRNGKey(7), 2)
    init = (jnp.int32(0), jnp.zeros(16))
    return jax.random.normal(k[0], (16, 16)) / 4, init, jax.random.normal(k[1], (num_steps, 16))


def _conv(p, h, x):
    import jax
    import jax.numpy as jnp

    y = jax.lax.conv_general_dilated(h[None], p, (1,), "SAME")[0]
    h = jnp.tanh(y + x)
    return h, jnp.mean(h)


def _conv_inputs(num_steps):
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.PRNGKey(8), 2)
    kernel = jax.random.normal(k[0], (8, 8, 5)) / 6
    return kernel, jnp.zeros((8, 128)), 0.1 * jax.random.normal(k[1], (num_steps, 8, 128))


def _attention(p, h, x):
    """Attention over fixed keys: the step reads a weight and its transpose."""
    import jax
    import jax.numpy as jnp

    a = jax.nn.softmax(p["M"] @ h)
    h = jnp.tanh(p["M"].T @ a + x)
    return h, jnp.sum(a * a)


def _attention_inputs(num_steps):
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.PRNGKey(11), 2)
    params = {"M": jax.random.normal(k[0], (16, 32)) / 4}
    return params, jnp.zeros(32), 0.1 * jax.random.normal(k[1], (num_steps, 32))


def _wide_input(p, h, x):
    """A small state driven by a wide input: the step's cost is the input's product."""
    import jax.numpy as jnp

    h = jnp.tanh(p["W"] @ x + p["U"] @ h)
    return h, h[0]


def _wide_input_inputs(num_steps):
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.PRNGKey(13), 3)
    params = {
        "W": jax.random.normal(k[0], (8, 512)) / 24,
        "U": jax.random.normal(k[1], (8, 8)) / 3,
    }
    return params, jnp.zeros(8), jax.random.normal(k[2], (num_steps, 512))


def _readout(p, h, x):
    """A small state whose output is a wide outer product, summed."""
    import jax.numpy as jnp

    h = jnp.tanh(p["U"] @ h + x)
    return h, jnp.sum(jnp.outer(h, p["v"]))


def _readout_inputs(num_steps):
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.PRNGKey(14), 3)
    params = {"U": jax.random.normal(k[0], (8, 8)) / 3, "v": jax.random.normal(k[1], (256,))}
    return params, jnp.zeros(8), 0.1 * jax.random.normal(k[2], (num_steps, 8))


def _bf16_state(p, h, x):
    """A bfloat16 state, computed in float32."""
    import jax.numpy as jnp

    h = jnp.tanh(p["w"] * h.astype(jnp.float32) + x).astype(jnp.bfloat16)
    return h, jnp.mean(h.astype(jnp.float32))


def _bf16_state_inputs(num_steps):
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.PRNGKey(16), 2)
    params = {"w": 0.9 + 0.05 * jax.random.normal(k[0], (512,))}
    xs = 0.1 * jax.random.normal(k[1], (num_steps, 512))
    return params, jnp.zeros(512, jnp.bfloat16), xs


def _logsumexp(p, h, x):
    """A logsumexp over a wide broadcast of the state and the weights: one step
    back-propagated alone holds the broadcast, its exponentials and their cotangent."""
    import jax
    import jax.numpy as jnp

    z = h[:, None] * p[None, :] + x[:, None]
    h = jnp.tanh(jax.nn.logsumexp(z, axis=1) * 0.1)
    return h, jnp.sum(h)


def _max_wide(p, h, x):
    """A max over a wide broadcast: its derivative keeps a mask of the broadcast."""
    import jax.numpy as jnp

    h = jnp.tanh(jnp.max(h[:, None] * p[None, :], axis=1) + x)
    return h, jnp.sum(h)


def _tally(p, c, x):
    """A state of 256 floats and a tally of its signs, 1024 int32 that no derivative
    reads."""
    import jax.numpy as jnp

    h, tally = c
    h = jnp.tanh(h * p + x)
    return (h, tally + (jnp.tile(h, 4) > 0).astype(jnp.int32)), jnp.sum(h)


def _tally_inputs(num_steps):
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.PRNGKey(19), 2)
    xs = 0.3 * jax.random.normal(k[1], (num_steps, 256))
    init = (jnp.zeros(256), jnp.zeros(1024, jnp.int32))
    return 1.0 + 0.1 * jax.random.normal(k[0], (256,)), init, xs


def _wide_inputs(rows, width, seed):
    def make(num_steps):
        import jax
        import jax.numpy as jnp

        k = jax.random.split(jax.random.PRNGKey(seed), 2)
        xs = 0.3 * jax.random.normal(k[1], (num_steps, rows))
        return jax.random.normal(k[0], (width,)) / 4, jnp.zeros(rows), xs

    return make


BODIES = {
    b.name: b
    for b in (
        Body(
            "tanh4", "`tanh(W @ h + x)`, 4 floats, W differentiated", _matvec, _tanh_inputs(4, True)
        ),
        Body("elem256", "`tanh(w * h + x)`, 256 floats", _elementwise, _tanh_inputs(256, False)),
        Body("matvec128", "`tanh(W @ h + x)`, 128 floats", _matvec, _tanh_inputs(128, True)),
        Body("lstm32", "LSTM, hidden 32, batch 16", _common.lstm_step, _lstm_inputs(32, 16)),
        Body("lstm256", "LSTM, hidden 256, batch 32", _common.lstm_step, _lstm_inputs(256, 32)),
        Body("gru64", "GRU, hidden 64, batch 8", _gru, _gru_inputs(64, 8)),
        Body("velocity64", "64 floats and their velocity", _velocity, _velocity_inputs),
        Body("scalar", "`tanh(a * h + b * x)`, a scalar", _scalar, _scalar_inputs),
        Body("elem4096", "`tanh(w * h + x)`, 4096 floats", _elementwise, _wave_inputs(4096)),
        Body("rk4mlp", "an RK4 step of a two-layer field, 32 floats", _rk4, _rk4_inputs),
        Body(
            "mixed256",
            "`tanh(s * (W @ h) + x)`, W @ h in bfloat16",
            _mixed,
            _mixed_inputs,
            BF16_RTOL,
        ),
        Body("counter16", "16 floats and an integer counter", _counter, _counter_inputs),
        Body("conv8x128", "a convolution, 8 channels of 128", _conv, _conv_inputs),
        Body("attn32", "attention over 16 fixed keys, 32 floats", _attention, _attention_inputs),
        Body("bigx8", "8 floats driven by 512-float inputs", _wide_input, _wide_input_inputs),
        Body("ysbig8", "8 floats, a 256-wide outer product summed", _readout, _readout_inputs),
        Body("bf16c512", "a bfloat16 state of 512", _bf16_state, _bf16_state_inputs, BF16_RTOL),
        Body("lse48", "logsumexp over a 48 x 256 broadcast", _logsumexp, _wide_inputs(48, 256, 17)),
        Body("max32", "max over a 32 x 512 broadcast", _max_wide, _wide_inputs(32, 512, 18)),
        Body("tally256", "256 floats and a tally of 1024 int32", _tally, _tally_inputs),
    )
}


# The ways to run the loop: run(step, init, xs) -> (carry, ys) ------------------------


def segment_length(num_steps: int, levels: int) -> int:
    """The inner segments' length for a nest of ``levels`` over ``num_steps``: about
    ``num_steps ** ((levels - 1) / levels)``, the nearest divisor where one lies within 2x
    of that (no remainder, no copy of the inputs), else that length rounded."""
    target = num_steps ** ((levels - 1) / levels)
    near = [
        d for d in range(max(1, math.ceil(target / 2)), int(target * 2) + 1) if num_steps % d == 0
    ]
    if near:
        return min(near, key=lambda d: (abs(math.log(d / target)), d))
    return max(1, round(target))


def nested_scan(step, init, xs, levels: int):
    """A ``lax.scan`` over segments, each a ``jax.checkpoint``-ed nest of ``levels - 1``
    levels; a remainder (when the segment length does not divide the steps) runs as one
    more, shorter checkpointed segment. ``levels=1`` is ``lax.scan``."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    num_steps = jax.tree_util.tree_leaves(xs)[0].shape[0]
    if levels <= 1 or num_steps <= 2:
        return lax.scan(step, init, xs)
    inner = segment_length(num_steps, levels)
    count, rest = divmod(num_steps, inner)
    tree = jax.tree_util.tree_map

    def segment(c, xs_seg):
        return nested_scan(step, c, xs_seg, levels - 1)

    head = tree(lambda a: a[: count * inner].reshape(count, inner, *a.shape[1:]), xs)
    carry, ys = lax.scan(jax.checkpoint(segment), init, head)
    ys = tree(lambda y: y.reshape(count * inner, *y.shape[2:]), ys)
    if rest:
        carry, ys_rest = jax.checkpoint(segment)(carry, tree(lambda a: a[count * inner :], xs))
        ys = tree(lambda a, b: jnp.concatenate([a, b]), ys, ys_rest)
    return carry, ys


def nested_checkpoints(num_steps: int) -> int:
    """The carries nested sqrt(T) holds at once: its segments plus one segment's steps."""
    inner = segment_length(num_steps, 2)
    return -(-num_steps // inner) + inner


def equinox_scan(step, init, xs, checkpoints: int):
    """The loop as Equinox's checkpointed while loop; ``ys`` summed as it goes (the loss
    only needs their sum)."""
    import equinox.internal as eqxi
    import jax
    import jax.numpy as jnp
    from jax import lax

    num_steps = jax.tree_util.tree_leaves(xs)[0].shape[0]

    def body(state):
        i, carry, total = state
        x = jax.tree_util.tree_map(lambda a: lax.dynamic_index_in_dim(a, i, 0, False), xs)
        carry, y = step(carry, x)
        return i + 1, carry, total + sum(jnp.sum(a) for a in jax.tree_util.tree_leaves(y))

    _, carry, total = eqxi.while_loop(
        lambda state: state[0] < num_steps,
        body,
        (jnp.int32(0), init, jnp.float32(0.0)),
        max_steps=num_steps,
        kind="checkpointed",
        checkpoints=checkpoints,
    )
    return carry, total


def peer_runs(num_steps: int) -> dict[str, Callable]:
    """The peers, by name, as ``run(step, init, xs)`` (Equinox only where it imports)."""
    import jax
    from jax import lax

    runs = {
        "lax.scan": lambda f, c, xs: lax.scan(f, c, xs),
        "checkpoint per step": lambda f, c, xs: lax.scan(jax.checkpoint(f), c, xs),
        "nested sqrt(T)": lambda f, c, xs: nested_scan(f, c, xs, 2),
        "nested 3 levels": lambda f, c, xs: nested_scan(f, c, xs, 3),
    }
    try:
        import equinox.internal  # noqa: F401
    except ImportError:
        return runs
    checkpoints = nested_checkpoints(num_steps)
    runs["equinox"] = lambda f, c, xs: equinox_scan(f, c, xs, checkpoints)
    return runs


def memento_run(budget_bytes: int, executor: str) -> Callable:
    import memento

    return lambda f, c, xs: memento.scan(f, c, xs, memory=f"{budget_bytes}B", executor=executor)


def executor_support() -> dict[str, bool]:
    """Which executors this memento's ``scan`` accepts (an unknown one is a ValueError
    raised at the boundary, before anything is traced)."""
    import memento

    support = {}
    for executor in EXECUTORS:
        try:
            memento.scan(lambda c, x: (c, None), 0.0, None, length=1, executor=executor)
            support[executor] = True
        except ValueError as e:
            if "executor" not in str(e):
                raise
            support[executor] = False
    return support


def loss_of(cell: Callable, run: Callable) -> Callable:
    """``loss(weights, init, xs) = sum(ys) + sum(final carry)`` with ``run`` as the loop."""
    import jax
    import jax.numpy as jnp

    def loss(weights, init, xs):
        carry, ys = run(lambda c, x: cell(weights, c, x), init, xs)
        leaves = jax.tree_util.tree_leaves((ys, carry))
        return sum(jnp.sum(leaf) for leaf in leaves)

    return loss


# Measuring ------------------------------------------------------------------------------


@dataclasses.dataclass
class Method:
    """One compiled gradient: its temp bytes and, if run, its gradient and call."""

    temp_bytes: int
    compile_s: float
    call: Callable[[], Any] | None = None
    grad: Any = None


def compile_grad(loss: Callable, args: tuple, max_run_bytes: int) -> Method:
    """Compiles ``jit(grad(loss))`` for ``args``; runs it once if its temp bytes fit."""
    import jax

    start = time.perf_counter()
    compiled = jax.jit(jax.grad(loss)).lower(*args).compile()
    compile_s = time.perf_counter() - start
    temp = int(compiled.memory_analysis().temp_size_in_bytes)
    method = Method(temp_bytes=temp, compile_s=compile_s)
    if temp <= max_run_bytes:
        method.grad = jax.block_until_ready(compiled(*args))
        method.call = lambda: compiled(*args)
    return method


def _leaves(grad, reference):
    """Each leaf of ``grad`` and of ``reference`` in float64, and the reference leaf's
    largest magnitude (the scale errors are relative to)."""
    import jax

    for g, r in zip(jax.tree_util.tree_leaves(grad), jax.tree_util.tree_leaves(reference)):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        yield g, r, max(float(np.abs(r).max()), 1e-30)


def relative_error(grad, reference) -> float:
    """The largest difference between ``grad`` and ``reference``, relative to the
    reference's largest entry, over all leaves."""
    return max(
        (float(np.abs(g - r).max()) / s for g, r, s in _leaves(grad, reference)), default=0.0
    )


def check_gradient(name: str, grad, reference, rtol: float = RTOL) -> float:
    """Asserts ``grad`` equals ``reference`` to ``rtol`` (float32's by default); returns
    `relative_error`."""
    for g, r, scale in _leaves(grad, reference):
        np.testing.assert_allclose(g, r, rtol=rtol, atol=rtol * scale, err_msg=name)
    return relative_error(grad, reference)


def within_bytes(temp: int, budget: int) -> bool:
    factor, extra = BYTES_SLACK
    return temp <= budget * factor + extra


def schedule_of(body: Body, args: tuple, budget_bytes: int, executor: str) -> dict | None:
    """What memento plans for this budget (`memento.explain`): the executor and policy,
    forward evaluations, loop iterations, the predicted bytes and seconds, and why (a
    static plan's segment lengths), on the platform the inputs are on."""
    import memento

    weights, init, xs = args
    try:
        plan = memento.explain(
            lambda c, x: body.cell(weights, c, x),
            init,
            xs,
            memory=f"{budget_bytes}B",
            executor=executor,
            wrt=("closure",),
        )
    except Exception:  # a refusal is recorded by the run itself
        return None
    return {
        "backend": plan.backend,
        "executor": plan.executor,
        "policy": plan.policy,
        "slots": int(plan.slots),
        "cost": float(plan.evaluations),
        "loop_iterations": float(plan.loop_iterations),
        "program_bytes": int(plan.program_bytes),
        "predicted_s": float(plan.seconds),
        "why": plan.why,
    }


def measure(body: Body, num_steps: int, args_: argparse.Namespace, support: dict) -> dict:
    """Peers and memento for one body and length: bytes, gradient checks, then times."""
    import jax

    args = body.make(num_steps)
    cap = args_.max_run_bytes
    peers = {}
    for name, run in peer_runs(num_steps).items():
        peers[name] = compile_grad(loss_of(body.cell, run), args, cap)
        _log(f"  {name}: temp {peers[name].temp_bytes} B")
    methods = dict(peers)
    budgets = []
    for label in BUDGETS:
        entry, compiled = memento_at(body, args, label, peers, args_.executors, support, cap)
        budgets.append(entry)
        methods |= compiled
    reference, errors, mismatched = check_gradients(
        f"{body.name} T={num_steps}", peers, methods, body.rtol, args_.keep_going
    )

    calls = {n: m.call for n, m in methods.items() if m.call is not None}
    times = (
        _common.time_round_robin(calls, repeats=args_.rounds, min_round_s=args_.min_round_s)
        if calls
        else {}
    )
    seconds = {n: _common.median(v) for n, v in times.items()}
    for entry in budgets:
        for record in entry["memento"].values():
            if record["status"] == "ok":
                score(record, entry, methods, seconds, errors, mismatched)
    jax.clear_caches()
    return {
        "body": body.name,
        "label": body.label,
        "T": num_steps,
        "gradient_reference": reference,
        "nested_segment": segment_length(num_steps, 2),
        "equinox_checkpoints": nested_checkpoints(num_steps) if "equinox" in peers else None,
        "peers": {
            n: {
                "temp_bytes": m.temp_bytes,
                "time_s": seconds.get(n),
                "compile_s": m.compile_s,
                "grad_error": errors.get(n),
                "grad_ok": n not in mismatched,
            }
            for n, m in peers.items()
        },
        "budgets": budgets,
    }


def memento_at(
    body: Body, args: tuple, label: str, peers: dict, executors: str, support: dict, cap: int
) -> tuple[dict, dict[str, Method]]:
    """memento's gradient compiled at one of `BUDGETS`, with each executor of
    ``executors`` (comma-separated); a budget it refuses is recorded with the message.

    Returns:
        The budget's entry (one record per executor, filled in by `score` once timed) and
        the compiled gradients by method name.
    """
    idiom, fraction, reference, target = BUDGETS[label]
    budget = int(peers[idiom].temp_bytes * fraction)
    entry = {
        "budget": label,
        "budget_bytes": budget,
        "budget_of": idiom,
        "fraction": fraction,
        "time_reference": reference,
        "time_target": target,
        "memento": {},
    }
    compiled = {}
    for executor in executors.split(","):
        if not support[executor]:
            entry["memento"][executor] = {"status": "unsupported"}
            continue
        key = f"memento {executor} @ {label}"
        try:
            compiled[key] = compile_grad(
                loss_of(body.cell, memento_run(budget, executor)), args, cap
            )
        except ValueError as e:
            entry["memento"][executor] = {"status": "refused", "message": str(e)}
            _log(f"  {key}: refused ({e})")
            continue
        plan = schedule_of(body, args, budget, executor)
        entry["memento"][executor] = {"status": "ok", "method": key, "plan": plan}
        _log(f"  {key}: temp {compiled[key].temp_bytes} B (budget {budget} B)")
    return entry, compiled


def check_gradients(
    where: str, peers: dict, methods: dict, rtol: float = RTOL, keep_going: bool = False
) -> tuple[str | None, dict, set]:
    """Every gradient that ran against lax.scan's (or, past the memory cap, the first peer
    that ran); raises AssertionError on a mismatch, unless ``keep_going``: then the
    mismatch is logged and the method fails.

    Returns:
        The reference's name, each method's `relative_error`, and the methods whose
        gradient mismatched.
    """
    ran = [n for n in PEERS if n in peers and peers[n].grad is not None]
    if not ran:
        return None, {}, set()
    reference = methods[ran[0]].grad
    errors, mismatched = {}, set()
    for name, m in methods.items():
        if m.grad is None:
            continue
        try:
            errors[name] = check_gradient(
                f"{where}: {name} against {ran[0]}", m.grad, reference, rtol
            )
        except AssertionError as e:
            if not keep_going:
                raise
            errors[name] = relative_error(m.grad, reference)
            mismatched.add(name)
            _log(f"  GRADIENT MISMATCH {e}")
    return ran[0], errors, mismatched


def score(
    record: dict, entry: dict, methods: dict, seconds: dict, errors: dict, mismatched: set
) -> None:
    """Fills a memento record: bytes and time as ratios, and whether each target holds."""
    key = record.pop("method")
    m = methods[key]
    t, ref_time = seconds.get(key), seconds.get(entry["time_reference"])
    ratio = t / ref_time if t is not None and ref_time else None
    budget = entry["budget_bytes"]
    record.update(
        temp_bytes=m.temp_bytes,
        temp_over_budget=m.temp_bytes / budget if budget else None,
        time_s=t,
        time_ratio=ratio,
        compile_s=m.compile_s,
        grad_error=errors.get(key),
        grad_ok=key not in mismatched,
        temp_ok=within_bytes(m.temp_bytes, budget),
        time_ok=None if ratio is None else ratio <= entry["time_target"],
    )
    record["pass"] = bool(record["grad_ok"] and record["temp_ok"] and record["time_ok"])


def first_calls(body: Body, num_steps: int, rounds: int, max_run_bytes: float) -> dict:
    """First calls (trace, plan, compile, run) of lax.scan, nested sqrt(T) and memento at
    nested sqrt(T)'s bytes, each fresh: a new closure, JAX's caches cleared; the median
    of ``rounds`` (interleaved). lax.scan is left out where its gradient's temp bytes
    exceed ``max_run_bytes`` (at 10^6 steps of a wide step, more than the machine has):
    the ratios are then to nested sqrt(T)'s alone."""
    import jax

    args = body.make(num_steps)
    runs = peer_runs(num_steps)
    budget = compile_grad(loss_of(body.cell, runs["nested sqrt(T)"]), args, -1).temp_bytes
    full = compile_grad(loss_of(body.cell, runs["lax.scan"]), args, -1).temp_bytes
    makers = {
        "lax.scan": lambda: peer_runs(num_steps)["lax.scan"],
        "nested sqrt(T)": lambda: peer_runs(num_steps)["nested sqrt(T)"],
        "memento auto": lambda: memento_run(budget, "auto"),
    }
    if full > max_run_bytes:
        del makers["lax.scan"]
    stages: dict[str, list[dict]] = {n: [] for n in makers}
    for _ in range(rounds):
        for name, make in makers.items():
            jax.clear_caches()
            _clear_memento_caches()
            loss = loss_of(body.cell, make())
            _, timing = _common.first_call(jax.grad(loss), *args)
            stages[name].append(timing)
            _log(f"  first call {name}: {timing['first_s']:.2f} s")
    out = {
        "body": body.name,
        "T": num_steps,
        "memento_budget_bytes": budget,
        "lax_scan_temp_bytes": full,
        "methods": {},
    }
    for name, runs_ in stages.items():
        out["methods"][name] = {k: _common.median([r[k] for r in runs_]) for k in runs_[0]}
    for reference, key in (("lax.scan", "vs_lax_scan"), ("nested sqrt(T)", "vs_nested")):
        if reference in out["methods"]:
            base = out["methods"][reference]["first_s"]
            for rec in out["methods"].values():
                rec[key] = rec["first_s"] / base
    memento = out["methods"]["memento auto"]
    out["memento_ok"] = memento["vs_lax_scan"] <= 2.0 if "vs_lax_scan" in memento else None
    return out


def _clear_memento_caches() -> None:
    """memento's own caches of plans and programs (a first call must plan and compile
    afresh)."""
    for owner, attr in (("planning._choose", "_plan"), ("loops._choice", "_compile")):
        getattr(importlib.import_module(f"memento.{owner}"), attr).cache_clear()


def summary(results: list[dict]) -> dict:
    """Per executor and budget: how many (body, T) met both targets, of those measured."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for r in results:
        for entry in r["budgets"]:
            for executor, record in entry["memento"].items():
                if record["status"] == "unsupported":
                    continue
                counts = out.setdefault(executor, {}).setdefault(
                    entry["budget"], {"passed": 0, "measured": 0, "refused": 0}
                )
                if record["status"] == "refused":
                    counts["refused"] += 1
                else:
                    counts["measured"] += 1
                    counts["passed"] += bool(record["pass"])
    return out


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# Tables ---------------------------------------------------------------------------------


def _size(num_bytes: float | None) -> str:
    if num_bytes is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{_digits(num_bytes / scale)} {unit}"
    return f"{int(num_bytes)} B"


def _digits(x: float) -> str:
    """Three significant digits, a whole number from 999.5 up (not ``1e+03``)."""
    return f"{x:.3g}" if x < 999.5 else f"{x:.0f}"


def _secs(s: float | None) -> str:
    if s is None:
        return "not run"
    return f"{_digits(s * 1e3)} ms" if s < 1 else f"{_digits(s)} s"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _cell(record: dict | None) -> str:
    """``temp / budget, time / reference`` and which targets it missed."""
    if record is None:
        return "not measured"
    if record["status"] != "ok":
        return record["status"]
    missed = [what for what in ("grad", "temp", "time") if record.get(f"{what}_ok") is False]
    mark = f"FAIL {' and '.join(missed)}" if missed else ("pass" if record["pass"] else "?")
    return f"{_ratio(record['temp_over_budget'])}, {_ratio(record['time_ratio'])} {mark}"


def headline(results: list[dict]) -> list[str]:
    """memento ``auto`` at the three budgets, one row per body and length (the lines of a
    markdown table): each idiom's temp and time, then memento's temp / budget and time /
    that idiom's (nested sqrt(T)'s for the quarter)."""
    lines = [
        "### memento (auto) at its peers' own bytes",
        "",
        "| body | T | nested sqrt(T): temp, time | memento at the same bytes: temp / budget, "
        "time / nested | checkpoint per step: temp, time | memento at the same bytes: temp / "
        "budget, time / per step | memento at a quarter of nested's bytes: temp / budget, "
        "time / nested |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        budgets = {b["budget"]: b for b in r["budgets"]}
        cells = []
        for label in BUDGETS:
            idiom = BUDGETS[label][0]
            if label != "quarter nested":
                peer = r["peers"][idiom]
                cells.append(f"{_size(peer['temp_bytes'])}, {_secs(peer['time_s'])}")
            cells.append(_cell(budgets[label]["memento"].get("auto")))
        lines.append(f"| {r['label']} | {r['T']} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def markdown(data: dict) -> str:
    """The results as markdown tables: the headline (memento auto), one per budget with
    every executor, the peers, then first calls."""
    results = data["results"]
    machine = data["machine"]
    where = (
        f"CPU: {machine.get('processor')}"
        if machine.get("backend", "cpu") == "cpu"
        else f"{machine['backend'].upper()}: {', '.join(machine['devices'])}"
    )
    settings = data["settings"]
    rounds = (
        f"{settings['rounds']} rounds"
        if results
        else f"{settings.get('first_call_rounds')} rounds of first calls"
    )
    lines = [f"{where}; jax {machine.get('jax')}; {rounds}; {data['date']}.", ""]
    lines += headline(results) if results else []  # --steps "": first calls only
    titles = {
        "nested sqrt(T)": "memento at nested sqrt(T)'s bytes (targets: temp <= budget "
        "x 1.05 + 4 KiB, time <= 1.1x nested)",
        "checkpoint per step": "memento at checkpoint per step's bytes (targets: temp "
        "<= budget x 1.05 + 4 KiB, time <= 1.1x checkpoint per step)",
        "quarter nested": "memento at a quarter of nested sqrt(T)'s bytes (targets: "
        "temp <= budget x 1.05 + 4 KiB, time <= 1.6x nested)",
    }
    for label, title in titles.items() if results else ():
        idiom, _, reference, _ = BUDGETS[label]
        head = f"| body | T | {idiom}: temp, time | budget | " + " | ".join(EXECUTORS) + " |"
        lines += [
            f"### {title}",
            "",
            f"memento's cells: temp / budget, time / {reference}'s time.",
            "",
            head,
            "| --- | --- | --- | --- |" + " --- |" * len(EXECUTORS),
        ]
        for r in results:
            entry = next(b for b in r["budgets"] if b["budget"] == label)
            peer = r["peers"][idiom]
            cells = [_cell(entry["memento"].get(e)) for e in EXECUTORS]
            lines.append(
                f"| {r['label']} | {r['T']} | {_size(peer['temp_bytes'])}, "
                f"{_secs(peer['time_s'])} | {_size(entry['budget_bytes'])} | "
                + " | ".join(cells)
                + " |"
            )
        lines.append("")
    lines += (
        [
            "### The peers: temp, time",
            "",
            "| body | T | " + " | ".join(PEERS) + " |",
            "| --- | --- |" + " --- |" * len(PEERS),
        ]
        if results
        else []
    )
    for r in results:
        cells = [
            f"{_size(r['peers'][p]['temp_bytes'])}, {_secs(r['peers'][p]['time_s'])}"
            if p in r["peers"]
            else "not installed"
            for p in PEERS
        ]
        lines.append(f"| {r['label']} | {r['T']} | " + " | ".join(cells) + " |")
    if data.get("first_call"):
        lines += [
            "",
            "### First call (trace, plan, compile, run)",
            "",
            "| body | T | lax.scan | nested sqrt(T) | memento auto at nested's bytes |",
            "| --- | --- | --- | --- | --- |",
        ]
        for fc in data["first_call"]:
            lines.append(f"| {BODIES[fc['body']].label} | {fc['T']} | " + _first_cells(fc) + " |")
    return "\n".join(lines) + "\n"


def _first_cells(fc: dict) -> str:
    """A first-call row's cells: each method's time and its ratio to lax.scan's, or to
    nested sqrt(T)'s where lax.scan's gradient did not fit the machine."""
    m = fc["methods"]
    cells = []
    for name in ("lax.scan", "nested sqrt(T)", "memento auto"):
        if name not in m:
            cells.append(f"not run: {_size(fc['lax_scan_temp_bytes'])} of temp")
        elif "vs_lax_scan" in m[name]:
            cells.append(f"{_secs(m[name]['first_s'])} ({_ratio(m[name]['vs_lax_scan'])})")
        else:
            cells.append(f"{_secs(m[name]['first_s'])} ({_ratio(m[name]['vs_nested'])} nested)")
    return " | ".join(cells)


# Entry point ----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--steps", default="1e4,1e5", help='comma-separated lengths T ("": first calls only)'
    )
    parser.add_argument("--bodies", default=",".join(BODIES), help=f"of {', '.join(BODIES)}")
    parser.add_argument(
        "--executors", default=",".join(EXECUTORS), help="memento's executors to measure"
    )
    parser.add_argument("--rounds", type=int, default=5, help="round-robin timing rounds")
    parser.add_argument(
        "--min-round-s",
        type=float,
        default=0.05,
        help="a faster call runs back to back for this long per round (its mean recorded)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke preset: T=1000, tanh4 and lstm32, 3 rounds"
    )
    parser.add_argument(
        "--first-call", action="store_true", help="also time first calls at --first-call-steps"
    )
    parser.add_argument("--first-call-steps", default="1e6")
    parser.add_argument("--first-call-rounds", type=int, default=3)
    parser.add_argument(
        "--first-call-bodies",
        default="tanh4",
        help="bodies for --first-call (lax.scan stores all T steps)",
    )
    parser.add_argument(
        "--max-run-bytes",
        type=float,
        default=4 * 2**30,
        help="compile but do not run methods with more temp bytes",
    )
    _common.add_threads_option(parser)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument(
        "--markdown", metavar="JSON", help="print the tables of an existing JSON and exit"
    )
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="record a gradient mismatch (the method fails) instead of stopping",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.bodies, args.rounds = "1e3", "tanh4,lstm32", 3
    args.max_run_bytes = int(args.max_run_bytes)
    unknown = set(args.bodies.split(",")) - set(BODIES)
    if unknown:
        parser.error(f"unknown bodies {sorted(unknown)}; choose from {', '.join(BODIES)}")
    unknown = set(args.executors.split(",")) - set(EXECUTORS)
    if unknown:
        parser.error(f"unknown executors {sorted(unknown)}; choose from {', '.join(EXECUTORS)}")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the benchmark (or renders ``--markdown``); returns the JSON's data."""
    args = parse_args(argv)
    if args.markdown:
        return _common.print_markdown(args.markdown, markdown)
    if args.threads == "one":
        _common.use_one_thread()
    import jax

    support = executor_support()
    _log(f"executors: {support}")
    load_before = os.getloadavg()
    results: list[dict] = []
    firsts: list[dict] = []
    machine = _common.machine()

    def snapshot() -> dict:
        return {
            "benchmark": "pareto",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": machine,
            "cpu_model": machine["processor"],
            "jax": machine["jax"],
            "settings": {
                "steps": args.steps,
                "bodies": args.bodies,
                "rounds": args.rounds,
                "first_call_rounds": args.first_call_rounds if args.first_call else None,
                "min_round_s": args.min_round_s,
                "executors": args.executors,
                "max_run_bytes": args.max_run_bytes,
                "threads": args.threads,
                "bytes_slack": list(BYTES_SLACK),
                "gradient_rtol": RTOL,
                "gradient_rtol_bfloat16": BF16_RTOL,
                # None: the backend's own (on NVIDIA GPUs, float32 operands as TF32).
                "matmul_precision": jax.config.jax_default_matmul_precision,
            },
            # The machine's 1-minute load average when the run began and ended: time
            # ratios of millisecond calls are steady only on a quiet machine.
            "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "executors": {e: ("supported" if ok else "unsupported") for e, ok in support.items()},
            "summary": summary(results),
            "results": results,
            "first_call": firsts,
        }

    # Written after every body too: a run stopped part way keeps what it measured.
    for num_steps in [int(float(s)) for s in args.steps.split(",") if s]:
        for name in args.bodies.split(","):
            _log(f"{name}, T={num_steps}")
            results.append(measure(BODIES[name], num_steps, args, support))
            _common.write_json(args.out, snapshot())
    if args.first_call:
        for num_steps in [int(float(s)) for s in args.first_call_steps.split(",")]:
            for name in args.first_call_bodies.split(","):
                _log(f"first call: {name}, T={num_steps}")
                firsts.append(
                    first_calls(BODIES[name], num_steps, args.first_call_rounds, args.max_run_bytes)
                )
                _common.write_json(args.out, snapshot())
    data = snapshot()
    path = _common.write_json(args.out, data)
    print(markdown(data), end="")
    _log(f"wrote {path}")
    return data


if __name__ == "__main__":
    main()
