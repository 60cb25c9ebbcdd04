"""The schedule walker of `memento.torch`: the rows of a `memento.planning.Schedule`,
run on tensors with PyTorch autograd.

The rows are those the JAX executors run (`memento.planning` documents them); the
machine is `memento.loops._chain._Replay`'s, eagerly: ADVANCE evaluates steps under
``torch.no_grad()`` (nothing kept), SAVE_HIDDEN keeps the current state's tensors,
SAVE_INTERNAL evaluates a step with grad enabled on detached copies of its inputs and
keeps the result, a `Record`: the step's autograd graph holds its saved tensors (its
internal state, the paper's ISM slot) until ``torch.autograd.grad`` back-propagates
it. BACKWARD_FUSED records the step from the current state and back-propagates it at
once. FREE rows drop the references, so memory follows the schedule.
A second backward pass through the same outputs (``retain_graph=True``, Jacobians,
``gradcheck``) runs the first sweep again first: its stored states were freed.

The first sweep (rows before `memento.planning.first_backward`) runs before the
``autograd.Function`` is applied, and produces the outputs; the rest runs in its
backward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..planning import Op
from ._probe import is_float


class Record:
    """One step evaluated with grad enabled: its graph is the internal state.

    Attributes:
        pos: the step.
        h_in, x_in: the detached inputs the graph starts from (float carry leaves require
            grad; an ``x`` leaf does when its ``xs`` leaf does).
        carry, y: the step's outputs, in the graph (``None`` once back-propagated).
        out: the output state, detached: what the next step starts from.
    """

    __slots__ = ("carry", "h_in", "out", "pos", "x_in", "y")

    def __init__(self, pos, h_in, x_in, carry, y):
        self.pos, self.h_in, self.x_in, self.carry, self.y = pos, h_in, x_in, carry, y
        self.out = [c.detach() for c in carry]


class Steps:
    """What the machine needs of a loop or chain (`memento.torch._scan`, `._chain`).

    Attributes:
        num_steps: t.
        params: every tensor, over all steps, that the steps use from outside and that
            receives a gradient.
    """

    num_steps: int
    params: list[torch.Tensor]

    def call(self, p: int, h: list, x: list) -> tuple[list, list]:
        """Step p on carry leaves ``h`` and ``x`` leaves: (carry leaves, y leaves)."""
        raise NotImplementedError

    def x(self, p: int) -> list[torch.Tensor]:
        """The ``x`` leaves of step p (views of ``xs``), detached; [] for chains."""
        return []

    def x_needs(self) -> list[bool]:
        return []

    def param_index(self, p: int) -> Sequence[int]:
        """Indices into ``params`` of the tensors step p uses."""
        return range(len(self.params))

    def emit(self, p: int, y: list) -> None:
        """Stores the ``y`` leaves of step p (first sweep only)."""

    def y_cotangent(self, p: int) -> list:
        """The cotangents of step p's ``y`` leaves (None: zero)."""
        return []


def record(steps: Steps, p: int, cur: list, x: list) -> Record:
    """Step p from the state ``cur`` with its graph kept (see `Record`)."""
    h_in = [c.detach().requires_grad_() if is_float(c) else c for c in cur]
    x_in = [xi.detach().requires_grad_() if n else xi for xi, n in zip(x, steps.x_needs())]
    with torch.enable_grad():
        carry, y = steps.call(p, h_in, x_in)
    return Record(p, h_in, x_in, carry, y)


class Machine:
    """Runs schedule rows (see the module docstring); counts evaluations of the steps."""

    def __init__(self, steps: Steps, h0: list, rows: np.ndarray, first: int):
        self.steps = steps
        self.h0 = [h.detach() for h in h0]
        self.rows, self.first = rows, first
        self.cur: list = list(self.h0)
        self.hidden: dict[int, list] = {}
        self.internal: dict[int, Record] = {}
        self.working: Record | None = None
        self.pre: Record | None = None  # step 0 evaluated by the probe
        self.evaluations = 0
        self.ct: list = []
        self.ct_x: list = []
        self.ct_params: list = []
        self.param_needs: list[bool] = []

    # -- evaluations ------------------------------------------------------------------

    def _plain(self, p: int) -> tuple[list, list]:
        if self.pre is not None and self.pre.pos == p:
            rec, self.pre = self.pre, None
            return rec.out, [y.detach() for y in rec.y]
        self.evaluations += 1
        with torch.no_grad():
            carry, y = self.steps.call(p, self.cur, self.steps.x(p))
        return [c.detach() for c in carry], y

    def _record(self, p: int) -> Record:
        if self.pre is not None and self.pre.pos == p:
            rec, self.pre = self.pre, None
            return rec
        self.evaluations += 1
        return record(self.steps, p, self.cur, self.steps.x(p))

    # -- the rows ---------------------------------------------------------------------

    def sweep(self, *, emit_ys: bool = True) -> list:
        """Runs the first sweep; returns the output state (every ``y`` emitted)."""
        self.cur, self.working = list(self.h0), None
        self.hidden.clear()
        self.internal.clear()
        emit = self.steps.emit if emit_ys else (lambda p, y: None)
        for op, arg, pos in self.rows[: self.first + 1].tolist():
            if op == Op.ADVANCE:
                for q in range(pos, pos + arg):
                    self.cur, y = self._plain(q)
                    emit(q, y)
            elif op == Op.SAVE_HIDDEN:
                self.hidden[arg] = self.cur
            elif op == Op.SAVE_INTERNAL:
                rec = self.internal[arg] = self._record(pos)
                emit(pos, [y.detach() for y in rec.y])
                self.cur = rec.out
            elif op == Op.BACKWARD_FUSED:  # the last step: its graph waits for backward
                rec = self.working = self._record(pos)
                emit(pos, [y.detach() for y in rec.y])
                self.cur = rec.out
            elif op == Op.FREE_HIDDEN:
                del self.hidden[arg]
            elif op == Op.FREE_INTERNAL:
                del self.internal[arg]
            # BACKWARD_INTERNAL ends the sweep; the current state is that slot's output.
        self.pre = None
        return self.cur

    def backward(self, ct: list, param_needs: list[bool]) -> None:
        """Runs the remaining rows from the output cotangents ``ct`` (None: zero).

        Leaves ``ct`` (of ``h_0``), ``ct_x`` (per step, per ``x`` leaf) and
        ``ct_params`` (summed over steps; None: zero).
        """
        self.ct = list(ct)
        self.param_needs = list(param_needs)
        self.ct_params = [None] * len(self.steps.params)
        self.ct_x = []
        for op, arg, pos in self.rows[self.first :].tolist():
            if op == Op.ADVANCE:
                for q in range(pos, pos + arg):
                    self.cur = self._plain(q)[0]
            elif op == Op.SAVE_HIDDEN:
                self.hidden[arg] = self.cur
            elif op == Op.SAVE_INTERNAL:
                rec = self.internal[arg] = self._record(pos)
                self.cur = rec.out
            elif op == Op.LOAD_HIDDEN:
                self.cur = self.h0 if arg == -1 else self.hidden[arg]
            elif op == Op.LOAD_INTERNAL:
                self.cur = self.internal[arg].out
            elif op == Op.BACKWARD_INTERNAL:
                self._backward(self.internal[arg])
            elif op == Op.BACKWARD_FUSED:
                rec = self.working if self.working is not None else self._record(pos)
                self.working = None
                self._backward(rec)
            elif op == Op.FREE_HIDDEN:
                del self.hidden[arg]
            elif op == Op.FREE_INTERNAL:
                del self.internal[arg]
        self.hidden.clear()
        self.internal.clear()

    def _backward(self, rec: Record) -> None:
        """``torch.autograd.grad`` of one recorded step; the graph is freed after."""
        steps, p = self.steps, rec.pos
        outs, gouts = [], []
        for o, g in zip([*rec.carry, *rec.y], [*self.ct, *steps.y_cotangent(p)]):
            if g is not None and o.requires_grad:
                outs.append(o)
                gouts.append(g)
        h_idx = [i for i, h in enumerate(rec.h_in) if h.requires_grad]
        x_idx = [j for j, x in enumerate(rec.x_in) if x.requires_grad]
        k_idx = [k for k in steps.param_index(p) if self.param_needs[k]]
        ins = [rec.h_in[i] for i in h_idx] + [rec.x_in[j] for j in x_idx]
        ins += [steps.params[k] for k in k_idx]
        rec.carry = rec.y = None  # the graph lives on in outs until grad frees it
        ct: list = [None] * len(rec.h_in)
        grads: Sequence = [None] * len(ins)
        if outs and ins:
            with torch.enable_grad():
                grads = torch.autograd.grad(outs, ins, gouts, allow_unused=True)
        for i, g in zip(h_idx, grads):
            ct[i] = g
        self.ct = ct
        gx = grads[len(h_idx) : len(h_idx) + len(x_idx)]
        self.ct_x.append((p, dict(zip(x_idx, gx))))
        for k, g in zip(k_idx, grads[len(h_idx) + len(x_idx) :]):
            if g is not None:
                self.ct_params[k] = g if self.ct_params[k] is None else self.ct_params[k] + g


def make_function(name: str) -> type[torch.autograd.Function]:
    """An ``autograd.Function`` whose backward runs a `Machine`'s remaining rows.

    Its inputs are the machine, then every tensor that may receive a gradient; its
    outputs, whatever ``outputs(machine)`` returns; ``grads(machine, cts, needs)`` turns
    the output cotangents into the inputs' gradients.
    """

    class Run(torch.autograd.Function):
        @staticmethod
        def forward(ctx, machine, outputs: Callable, grads: Callable, *inputs):
            ctx.machine, ctx.grads, ctx.used = machine, grads, False
            outs = tuple(o.detach() for o in outputs(machine))
            ctx.mark_non_differentiable(*(o for o in outs if not is_float(o)))
            return outs

        @staticmethod
        def backward(ctx, *cts):
            if torch.is_grad_enabled():  # create_graph=True: the result would lack terms
                raise NotImplementedError(
                    f"{name}: its gradient is first order only; a backward pass with "
                    "create_graph=True (a second derivative through the loop) is not "
                    "supported. Use memory=None (plain autograd) for higher derivatives."
                )
            machine, grads = ctx.machine, ctx.grads
            if ctx.used:  # the states stored were freed: store them again
                machine.sweep(emit_ys=False)
            ctx.used = True
            return (None, None, None, *grads(machine, list(cts), ctx.needs_input_grad[3:]))

    Run.__name__ = Run.__qualname__ = name.replace(".", "_")
    return Run
