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
Runs: where `memento.planning.internals.backward_runs` marks a row, the step is recorded on the
graph of the record below it (whose output it starts from, and which is
back-propagated right after it), and a run of such steps is back-propagated by one
``torch.autograd.grad`` when its bottom step's row comes: the same evaluations and the
same saved tensors alive (the engine frees each step's as it leaves it), one call
instead of one per step.
What the forward pass saw is replayed (`memento.torch._replay.Context`): the autocast
settings, the random number generators' states and the tensors the steps modify in
place, kept at every stored state and put back when the walk resumes from it. A step
that modifies its carry in place (`Steps.copies`) is given copies, so that no stored
state changes; a step that modifies its ``x`` raises.
A second backward pass through the same outputs (``retain_graph=True``, Jacobians,
``gradcheck``) runs the first sweep again first: its stored states were freed.

The first sweep (rows before `memento.planning.internals.first_backward`) runs before the
``autograd.Function`` is applied, and produces the outputs; the rest runs in its
backward pass.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Sequence

import torch

from ..planning import Op, Schedule
from ..planning.internals import backward_runs, first_backward
from ._probe import is_float
from ._replay import AutocastState, Context, Snapshot, autocast, autocast_state


class Record:
    """One step evaluated with grad enabled: its graph is the internal state.

    Attributes:
        pos: the step.
        h_in, x_in: the inputs the graph starts from: detached (float carry leaves require
            grad; an ``x`` leaf does when its ``xs`` leaf does), or, for ``h_in`` of a
            linked record, the carry of the record of step ``pos - 1`` itself.
        linked: whether the graph is built on step ``pos - 1``'s (`record`): the two are
            back-propagated together.
        carry, y: the step's outputs, in the graph (``None`` once back-propagated).
        out: the output state, detached: what the next step starts from.
    """

    __slots__ = ("carry", "h_in", "linked", "out", "pos", "x_in", "y")

    def __init__(self, pos, h_in, x_in, carry, y, *, linked: bool = False):
        self.pos, self.h_in, self.x_in, self.carry, self.y = pos, h_in, x_in, carry, y
        self.out = [c.detach() for c in carry]
        self.linked = linked


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

    def copies(self, p: int) -> bool:
        """Whether step p modifies its carry in place (it is then given copies)."""
        return False

    def grad_mode(self, p: int) -> bool:
        """Whether step p differentiates inside (it then always runs with grad)."""
        return False

    def param_index(self, p: int) -> Sequence[int]:
        """Indices into ``params`` of the tensors step p uses."""
        return range(len(self.params))

    def emit(self, p: int, y: list) -> None:
        """Stores the ``y`` leaves of step p (first sweep only)."""

    def y_cotangent(self, p: int) -> list:
        """The cotangents of step p's ``y`` leaves (None: zero)."""
        return []


def record(machine: Machine, p: int, cur: list, x: list, below: Record | None = None) -> Record:
    """Step p from the state ``cur`` with its graph kept (see `Record`).

    With ``below`` (the record of step p-1, whose output is ``cur``), the graph starts
    from ``below``'s carry rather than from detached copies of it, so that one
    ``torch.autograd.grad`` back-propagates both (`memento.planning.internals.backward_runs`).
    """
    if below is not None and below.carry is not None:
        h_in = [c if c.requires_grad else o for c, o in zip(below.carry, below.out)]
    else:
        below = None
        h_in = [c.detach().requires_grad_() if is_float(c) else c for c in cur]
    needs = machine.steps.x_needs()
    x_in = [xi.detach().requires_grad_() if n else xi for xi, n in zip(x, needs)]
    if torch.is_grad_enabled():  # the machine's walks enable grad once for all rows
        carry, y = machine.call(p, h_in, x_in)
    else:
        with torch.enable_grad():
            carry, y = machine.call(p, h_in, x_in)
    return Record(p, h_in, x_in, carry, y, linked=below is not None)


@contextlib.contextmanager
def _no_cast_cache():
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


def check_x(name: str, p: int, x: list, versions: list[int]) -> None:
    """Raises if step p modified one of its ``x`` leaves in place."""
    for j, (t, v) in enumerate(zip(x, versions)):
        if t._version != v:
            raise RuntimeError(
                f"{name}: step {p} modified its input x (leaf {j} of xs) in place; the "
                "backward pass recomputes steps from xs and would read the modified "
                "values. Compute out of place (x = x * 2 instead of x.mul_(2))."
            )


# The opcodes as plain ints: compared once per row.
_ADVANCE, _SAVE_HIDDEN, _SAVE_INTERNAL = int(Op.ADVANCE), int(Op.SAVE_HIDDEN), int(Op.SAVE_INTERNAL)
_LOAD_HIDDEN, _LOAD_INTERNAL = int(Op.LOAD_HIDDEN), int(Op.LOAD_INTERNAL)
_BACKWARD_INTERNAL, _BACKWARD_FUSED = int(Op.BACKWARD_INTERNAL), int(Op.BACKWARD_FUSED)
_FREE_HIDDEN, _FREE_INTERNAL = int(Op.FREE_HIDDEN), int(Op.FREE_INTERNAL)

# id(schedule) -> (schedule, rows, first backward, marks): the planner caches schedules,
# and reading one (a walk of its rows) costs as much as a short loop. The schedule is
# held so that its id is not reused while the entry lives.
_read: collections.OrderedDict = collections.OrderedDict()
_READ_SIZE = 32


def _rows(schedule: Schedule) -> tuple[list, int, list[bool]]:
    """The rows as lists, the first backward row, and `backward_runs`' marks (cached)."""
    key = id(schedule)
    if key in _read and _read[key][0] is schedule:
        _read.move_to_end(key)
        return _read[key][1:]
    rows = schedule.actions.tolist()
    entry = (schedule, rows, first_backward(schedule.actions), backward_runs(schedule).tolist())
    _read[key] = entry
    if len(_read) > _READ_SIZE:
        _read.popitem(last=False)
    return entry[1:]


class Machine:
    """Runs schedule rows (see the module docstring); counts evaluations of the steps.

    Runs of backward steps marked by `memento.planning.internals.backward_runs` are recorded as
    one graph and back-propagated by one ``torch.autograd.grad``: a call per run rather
    than per step (each call has a fixed cost of Python and engine set-up).
    """

    def __init__(self, steps: Steps, h0: list, schedule: Schedule, context: Context, name: str):
        self.steps, self.context, self.name = steps, context, name
        self.h0 = [h.detach() for h in h0]
        self.rows, self.first, self.links = _rows(schedule)
        self.cur: list = list(self.h0)
        self.below: Record | None = None  # the record whose output ``cur`` is
        self.hidden: dict[int, list] = {}
        self.internal: dict[int, Record] = {}
        # What the context was at each stored state (when it has anything to replay).
        self.snaps: dict[tuple[int, int], Snapshot] = {}
        self.at_start = True  # ``cur`` is h0, and the context is ``context.start``
        self.amp: AutocastState | None = None  # autocast to enter around each step
        self.working: Record | None = None
        self.pre: Record | None = None  # step 0 evaluated by the probe
        self.evaluations = 0
        self.ct: list = []
        self.ct_x: list = []
        self.ct_params: list = []
        self.param_needs: list[bool] = []
        self._run: list[Record] = []  # backward steps waiting for the bottom of their run

    # -- evaluations ------------------------------------------------------------------

    def call(self, p: int, h: list, x: list) -> tuple[list, list]:
        """Step p as the forward pass ran it: on copies of the carry if it modifies it
        in place, under the forward pass's autocast; raises if it modifies ``x``."""
        steps = self.steps
        copies = steps.copies(p)
        if copies:
            h = [t.clone() for t in h]
        else:
            h_versions = [t._version for t in h]
        x_versions = [t._version for t in x]
        if self.amp is None:
            out = steps.call(p, h, x)
        else:
            with autocast(self.amp):
                out = steps.call(p, h, x)
        check_x(self.name, p, x, x_versions)
        if not copies and any(t._version != v for t, v in zip(h, h_versions)):
            raise RuntimeError(
                f"{self.name}: step {p} modified its carry in place, which its first "
                "evaluation did not; the stored states would change. Compute out of place "
                "(h = h * 2 instead of h.mul_(2)), or in place at every step."
            )
        return out

    def _advance(self, start: int, stop: int, emit: Callable | None = None) -> None:
        """Steps ``start .. stop - 1`` under ``no_grad`` from ``cur``, only the carry
        kept (and each ``y`` passed to ``emit``, in the first sweep)."""
        cur = self.cur
        if self.pre is not None and self.pre.pos == start:  # step 0, run by the probe
            cur = self.pre.out
            if emit is not None:
                emit(start, [y.detach() for y in self.pre.y])
            self.pre = None
            start += 1
        self.at_start = False
        self.evaluations += stop - start
        x, steps = self.steps.x, self.steps
        for q in range(start, stop):
            if steps.grad_mode(q):  # the step differentiates: its inputs require grad
                rec = record(self, q, cur, x(q))
                cur, y = rec.out, [t.detach() for t in rec.y]
            else:
                # No cached autocast casts here: a cast made under no_grad would be
                # reused, without its graph, by the steps recorded after it.
                with torch.no_grad(), _no_cast_cache():
                    cur, y = self.call(q, cur, x(q))
            if emit is not None:
                emit(q, y)
        self.cur = [c.detach() for c in cur]  # a step may return a tensor needing grad

    def _record(self, p: int, i: int) -> Record:
        """Step p (row i) with its graph, on the graph below it when row i is marked."""
        below = self.below if self.links[i] else None
        if self.pre is not None and self.pre.pos == p:
            rec, self.pre = self.pre, None
        else:
            self.evaluations += 1
            rec = record(self, p, self.cur, self.steps.x(p), below)
        self.at_start = False
        self.below = rec
        return rec

    # -- the context at stored states -------------------------------------------------

    def _keep(self, kind: int, arg: int) -> None:
        if self.context.active:
            self.snaps[kind, arg] = self.context.start if self.at_start else self.context.save()

    def _resume(self, kind: int, arg: int) -> None:
        if self.context.active:
            self.context.load(self.context.start if arg == -1 else self.snaps[kind, arg])

    def _drop(self, kind: int, arg: int) -> None:
        self.snaps.pop((kind, arg), None)

    # -- the rows ---------------------------------------------------------------------

    def sweep(self, *, emit_ys: bool = True) -> list:
        """Runs the first sweep; returns the output state (every ``y`` emitted).

        The first time, the caller's context is the forward pass's; a second sweep (a
        second backward pass) starts from ``context.start``.
        """
        if not emit_ys and self.context.active:
            self.context.load(self.context.start)
        self.cur, self.working, self.below = list(self.h0), None, None
        self.at_start = True
        self.hidden.clear()
        self.internal.clear()
        self.snaps.clear()
        emit = self.steps.emit if emit_ys else None
        with torch.enable_grad():
            self._sweep(emit)
        self.pre = None
        return self.cur

    def _sweep(self, emit: Callable | None) -> None:
        for i, (op, arg, pos) in enumerate(self.rows[: self.first + 1]):
            if op == _ADVANCE:
                self.below = None
                self._advance(pos, pos + arg, emit)
            elif op == _SAVE_HIDDEN:
                self.hidden[arg] = self.cur
                self._keep(_SAVE_HIDDEN, arg)
            elif op == _SAVE_INTERNAL:
                rec = self.internal[arg] = self._record(pos, i)
                self._keep(_SAVE_INTERNAL, arg)
                if emit is not None:
                    emit(pos, [y.detach() for y in rec.y])
                self.cur = rec.out
            elif op == _BACKWARD_FUSED:  # the last step: its graph waits for backward
                rec = self.working = self._record(pos, i)
                if emit is not None:
                    emit(pos, [y.detach() for y in rec.y])
                self.cur = rec.out
            elif op == _FREE_HIDDEN:
                del self.hidden[arg]
                self._drop(_SAVE_HIDDEN, arg)
            elif op == _FREE_INTERNAL:
                del self.internal[arg]
                self._drop(_SAVE_INTERNAL, arg)
            # BACKWARD_INTERNAL ends the sweep; the current state is that slot's output.

    def backward(self, ct: list, param_needs: list[bool]) -> None:
        """Runs the remaining rows from the output cotangents ``ct`` (None: zero).

        Leaves ``ct`` (of ``h_0``), ``ct_x`` (per step, per ``x`` leaf) and
        ``ct_params`` (summed over steps; None: zero).
        """
        self.ct = list(ct)
        self.param_needs = list(param_needs)
        self.ct_params = [None] * len(self.steps.params)
        self.ct_x = []
        self._run = []
        self._owned: set[int] = set()  # entries of ct_params that are sums made here
        with torch.enable_grad():
            self._walk_backward()
        assert not self._run, "a run of backward steps was left without its bottom step"
        self.hidden.clear()
        self.internal.clear()
        self.snaps.clear()

    def _walk_backward(self) -> None:
        for i in range(self.first, len(self.rows)):
            op, arg, pos = self.rows[i]
            if op == _ADVANCE:
                self.below = None
                self._advance(pos, pos + arg)
            elif op == _SAVE_HIDDEN:
                self.hidden[arg] = self.cur
                self._keep(_SAVE_HIDDEN, arg)
            elif op == _SAVE_INTERNAL:
                rec = self.internal[arg] = self._record(pos, i)
                self._keep(_SAVE_INTERNAL, arg)
                self.cur = rec.out
            elif op == _LOAD_HIDDEN:
                self.below = None
                self.cur = self.h0 if arg == -1 else self.hidden[arg]
                self._resume(_SAVE_HIDDEN, arg)
            elif op == _LOAD_INTERNAL:
                self.below = self.internal[arg]
                self.cur = self.below.out
                self._resume(_SAVE_INTERNAL, arg)
            elif op == _BACKWARD_INTERNAL:
                self.below = None
                self._backward(self.internal[arg])
            elif op == _BACKWARD_FUSED:
                rec = self.working if self.working is not None else self._record(pos, i)
                self.working = self.below = None
                self._backward(rec)
            elif op == _FREE_HIDDEN:
                del self.hidden[arg]
                self._drop(_SAVE_HIDDEN, arg)
            elif op == _FREE_INTERNAL:
                del self.internal[arg]
                self._drop(_SAVE_INTERNAL, arg)

    def _backward(self, rec: Record) -> None:
        """Back-propagates ``rec``, with the run of linked records above it, in one
        ``torch.autograd.grad``; a linked record waits for the one below it."""
        self._run.append(rec)
        if rec.linked:
            return
        run, self._run = self._run, []
        steps, top = self.steps, run[0]
        outs, gouts = [], []
        assert top.carry is not None and rec.carry is not None
        for o, g in zip(top.carry, self.ct):
            if g is not None and o.requires_grad:
                outs.append(o)
                gouts.append(g)
        for r in run:
            assert r.y is not None
            for o, g in zip(r.y, steps.y_cotangent(r.pos)):
                if g is not None and o.requires_grad:
                    outs.append(o)
                    gouts.append(g)
        h_idx = [i for i, h in enumerate(rec.h_in) if h.requires_grad]
        ins = [rec.h_in[i] for i in h_idx]
        x_idx = []
        for r in run:
            x_idx.append([j for j, x in enumerate(r.x_in) if x.requires_grad])
            ins += [r.x_in[j] for j in x_idx[-1]]
        k_idx = sorted({k for r in run for k in steps.param_index(r.pos) if self.param_needs[k]})
        ins += [steps.params[k] for k in k_idx]
        for r in run:
            r.carry = r.y = None  # the graph lives on in outs until grad frees it
        ct: list = [None] * len(rec.h_in)
        grads: Sequence = [None] * len(ins)
        if outs and ins:
            with torch.enable_grad():
                grads = torch.autograd.grad(outs, ins, gouts, allow_unused=True)
        for i, g in zip(h_idx, grads):
            ct[i] = g
        self.ct = ct
        at = len(h_idx)
        for r, js in zip(run, x_idx):
            self.ct_x.append((r.pos, dict(zip(js, grads[at : at + len(js)]))))
            at += len(js)
        for k, g in zip(k_idx, grads[at:]):
            if g is None:
                continue
            acc = self.ct_params[k]
            if acc is None:
                self.ct_params[k] = g  # autograd's: it may alias a cotangent, keep it intact
            elif k in self._owned:
                acc.add_(g)  # a sum of ours: in place, no third tensor at the peak
            else:
                self.ct_params[k] = acc + g
                self._owned.add(k)


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
            context = machine.context
            context.check_versions(name)
            now = autocast_state()
            machine.amp = None if now == context.autocast else context.autocast
            with context.replaying():
                if ctx.used:  # the states stored were freed: store them again
                    machine.sweep(emit_ys=False)
                ctx.used = True
                out = grads(machine, list(cts), ctx.needs_input_grad[3:])
            machine.amp = None
            return (None, None, None, *out)

    Run.__name__ = Run.__qualname__ = name.replace(".", "_")
    return Run
