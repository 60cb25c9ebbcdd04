"""Static schedules: nested segments of static lengths, planned for a byte budget.

A *nest* of levels ``(K_1, ..., K_{n-1}, L)`` covers ``K_1 * ... * K_{n-1} * L`` steps.
The forward pass stores the carry at the start of each of its ``K_1`` outer segments. The
backward pass takes the outer segments last to first; for each it runs the segment
forward again, storing the starts of its ``K_2`` sub-segments, and so on down to the
innermost segments of ``L`` steps, which run once more keeping every step's residuals
(the step's internal states) and are back-propagated at once. A nest of one level ``(L,)``
keeps every residual from the forward pass on: plain BPTT over ``L`` steps.

A *static plan* is a sequence of nests (pieces) run one after another: a prefix stored
whole beside a nested remainder, or a remainder that does not fill a whole outer segment.
Its structure is fixed when the loop is traced, so an executor runs it as nested loops of
known trip counts (``lax.scan``), with no schedule to read.

Memory is counted in bytes: ``carry`` bytes per stored carry and ``residual`` bytes per
step's internal state, so a carry and an internal state need not be whole multiples of
each other. `nest_schedule` writes any plan as schedule rows, so `simulate` replays it
and counts its evaluations and peak slots as it does any schedule's.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable

import numpy as np

from ._schedule import INITIAL, Op, Schedule

__all__ = ["StaticPlan", "nest_schedule", "plan_static", "static_plan"]

SIMPLER = 0.03  # a plan of fewer loops is preferred within this share of the fastest time


@dataclasses.dataclass(frozen=True)
class StaticPlan:
    """Nests of static segment lengths, run in order (see the module docstring).

    Attributes:
        pieces: each piece's levels ``(K_1, ..., L)``, outermost first; a piece covers the
            product of its levels in steps, the pieces together every step in order.
        carry_bytes, residual_bytes: what one stored carry and one step's internal
            state take.
        stream_bytes: what a step of a segment being back-propagated takes besides its
            internal state: its slice of the outputs' cotangents.
        level_bytes: what each level of a nest beyond the second takes besides its stored
            starts (the executor's loop state for it).
        piece_bytes: what each nest beyond the first takes besides its stored starts
            (its loops' state, and the buffers XLA cannot share with another nest's).
        loop_bytes: what the backward pass's inner loops hold (their counters,
            predicates and loop state), in a plan that has any: a nest of more than two
            levels, or of innermost segments of more than one step. A plan of steps
            stored whole and nests of one-step segments has none (XLA inlines a loop of
            one trip), and a one-step segment's internal state is the step's in flight,
            which the caller's working set counts.
        start_bytes: what the stored start of a one-step segment keeps: the carry's
            leaves that its step's internal state depends on (XLA drops the others, as
            for ``lax.scan(jax.checkpoint(step))``); None for the whole carry.
        carry_rewrite_bytes, residual_rewrite_bytes: of a carry and of an internal
            state, the bytes in leaves whose stack a backend copies whole at each store
            into it (bfloat16 on CPU, see `LoopCosts.rewrite`): time, not memory.
        widened_bytes: what a stored outer start takes again, cast wider, while its
            nest is back-propagated: the leaves a step casts to a wider dtype, which XLA
            may cast for the whole stack at once, out of the backward loop.
        fill_bytes: what each nest keeps once besides its starts: the carry's leaves
            that no later step's residuals depend on, which its starts leave out
            (``carry_bytes`` counts the others), at the nest's first step.
        one_step_bytes: what a one-step segment back-propagated holds beyond the step
            in flight that the caller's working set counts (negative: short of it), in a
            plan that has any (a nest whose innermost segments are single steps): its
            step runs again and is back-propagated at once, as one step's gradient
            compiled alone. A plan of such nests only adds it; one that also
            back-propagates longer segments or steps stored whole, which hold the
            counted step, adds it only where it is positive.
    """

    pieces: tuple[tuple[int, ...], ...]
    carry_bytes: int
    residual_bytes: int
    stream_bytes: int = 0
    level_bytes: int = 0
    piece_bytes: int = 0
    loop_bytes: int = 0
    start_bytes: int | None = None
    carry_rewrite_bytes: int = 0
    residual_rewrite_bytes: int = 0
    widened_bytes: int = 0
    fill_bytes: int = 0
    one_step_bytes: int = 0

    @property
    def num_steps(self) -> int:
        return sum(math.prod(p) for p in self.pieces)

    @property
    def evaluations(self) -> int:
        """Forward evaluations of the step, the first sweep included (the paper's C)."""
        return sum(_piece_evaluations(p) for p in self.pieces)

    @property
    def peak_bytes(self) -> int:
        """Most bytes of stored carries and internal states live at once."""
        c, r = self.carry_bytes, self.residual_bytes
        c1 = c if self.start_bytes is None else self.start_bytes
        # The loop state of every nest beyond the first is held throughout. The forward
        # pass ends holding what every piece stores; the backward pass takes the pieces
        # last first, each freeing what it stored, so a nest's backward runs with what
        # the pieces before it store (a piece stored whole after it is already freed).
        nests = sum(len(p) > 1 for p in self.pieces)
        stored = [_piece_stored(p, c, r, c1) for p in self.pieces]
        held = max(0, nests - 1) * self.piece_bytes + nests * self.fill_bytes
        # The buffers a nest refills with its inner levels' starts: XLA was seen to keep
        # every nest's apart from the others', so a nest's backward runs beside the
        # others' too; and to allocate them before the pieces after the nests are
        # back-propagated, beside all that the forward pass stored.
        refills = [_piece_refills(p, c, c1) for p in self.pieces]
        all_refills = sum(refills)
        peak = held + sum(stored) + all_refills
        for p, kept, own in zip(self.pieces, stored, refills):
            if len(p) > 1:
                # A segment run again streams its slice of the cotangents; each level
                # beyond the second adds its loops' state; the outer starts, cast wider.
                extra = p[-1] * self.stream_bytes + (len(p) - 2) * self.level_bytes
                extra += p[0] * self.widened_bytes
                apart = all_refills - own
                peak = max(peak, held + _piece_peak(p, c, r, c1) + extra + apart)
            held += kept
        peak += self.loop_bytes if self.inner_loops else 0
        if not self.one_step_segments:
            return peak
        only = all(len(p) > 1 and p[-1] == 1 for p in self.pieces)
        return peak + (self.one_step_bytes if only else max(0, self.one_step_bytes))

    @property
    def one_step_segments(self) -> bool:
        """Whether a nest's innermost segments are single steps (see
        ``one_step_bytes``)."""
        return any(len(p) > 1 and p[-1] == 1 for p in self.pieces)

    @property
    def inner_loops(self) -> bool:
        """Whether the backward pass runs loops inside a nest's loop (see
        ``loop_bytes``)."""
        return any(len(p) > 2 or (len(p) == 2 and p[1] > 1) for p in self.pieces)

    @property
    def loop_iterations(self) -> int:
        """Iterations of the executor's loops, forward and backward (one per step or
        segment each loop visits): what a per-iteration overhead multiplies."""
        return sum(_piece_iterations(p) for p in self.pieces)

    @property
    def loop_starts(self) -> int:
        """Loops the executor starts, forward and backward (each segment's ``lax.scan``s
        among them): what a per-loop overhead multiplies."""
        return sum(_piece_starts(p) for p in self.pieces)

    @property
    def step_iterations(self) -> tuple[int, int]:
        """Iterations that each run one step, ``(separate, fused)``: ``fused`` those that
        run a step again and back-propagate it at once (a one-step segment's, in the
        backward pass), ``separate`` those of loops that run steps (forward, run again,
        keeping residuals) or back-propagate them (from stored residuals). A backend
        may run a loop body of more operations more slowly (`LoopCosts.dataflow`)."""
        separate = fused = 0
        for p in self.pieces:
            steps = math.prod(p)
            if len(p) == 1:
                separate += 2 * steps  # the forward keeping residuals, the pullbacks
                continue
            *ks, inner = p
            # Forward once; each level's refills run its K - 1 sub-segments again.
            separate += steps + sum(
                math.prod(ks[:d]) * (ks[d] - 1) * math.prod(p[d + 1 :]) for d in range(1, len(ks))
            )
            if inner == 1:
                fused += steps
            else:
                separate += 2 * steps
        return separate, fused

    def spilled_bytes(self, cache: float) -> int:
        """Bytes stored in stacks larger than ``cache``: the internal states of the
        pieces stored whole, and of every innermost segment, that outgrow it, and a
        nest's outer starts where they do (each stored once, and read back once)."""
        r = self.residual_bytes
        c1 = self.carry_bytes if self.start_bytes is None else self.start_bytes
        states = sum(math.prod(p) * r for p in self.pieces if p[-1] * r > cache)
        starts = sum(p[0] * c1 for p in self.pieces if len(p) > 1 and p[0] * c1 > cache)
        return states + starts

    @property
    def rewritten_bytes(self) -> int:
        """Bytes copied by stores into stacks that are copied whole at each store (see
        ``carry_rewrite_bytes``): a store into a stack of ``n`` entries copies ``n``."""
        cr, rr = self.carry_rewrite_bytes, self.residual_rewrite_bytes
        if not (cr or rr):
            return 0
        total = 0
        for p in self.pieces:
            if len(p) == 1:
                total += p[0] ** 2 * rr
                continue
            *ks, inner = p
            # The forward pass's stack of starts; each innermost segment's internal
            # states; each level's refilled buffer of K - 1 starts.
            total += ks[0] ** 2 * cr + math.prod(ks) * inner**2 * rr
            total += sum(math.prod(ks[:d]) * (ks[d] - 1) ** 2 * cr for d in range(1, len(ks)))
        return total

    @property
    def program_loops(self) -> int:
        """Loops in the executor's program, forward and backward: what its size, and so
        its trace and compile time, grows with."""
        # A piece stored whole: a loop each way. A nest of d levels: two forward (its
        # outer segments and each one's steps); backward, the loop over its innermost
        # segments and in it one refill loop per level below the outermost, the
        # segment's run keeping residuals and their pullbacks.
        return sum(2 if len(p) == 1 else len(p) + 3 for p in self.pieces)

    @property
    def depth(self) -> int:
        """Most levels of any piece: 1 is BPTT, 2 nested sqrt(T)-like."""
        return max(len(p) for p in self.pieces)


def _piece_evaluations(levels: tuple[int, ...]) -> int:
    steps = math.prod(levels)
    if len(levels) == 1:
        return steps  # residuals kept by the forward pass itself
    return steps + levels[0] * _segment_evaluations(levels[1:])


def _segment_evaluations(levels: tuple[int, ...]) -> int:
    """Evaluations to back-propagate one segment whose start carry is held."""
    if len(levels) == 1:
        return levels[0]
    # The last sub-segment's start is the carry the walk ends on: K - 1 run forward.
    return (levels[0] - 1) * math.prod(levels[1:]) + levels[0] * _segment_evaluations(levels[1:])


def _start(below: tuple[int, ...], c: int, c1: int) -> int:
    """Bytes of a stored start of a segment of levels ``below``: ``c1`` for one step."""
    return c1 if below == (1,) else c


def _piece_stored(levels: tuple[int, ...], c: int, r: int, c1: int) -> int:
    """Bytes a piece keeps from its forward pass until its backward."""
    return levels[0] * r if len(levels) == 1 else levels[0] * _start(levels[1:], c, c1)


def _piece_refills(levels: tuple[int, ...], c: int, c1: int) -> int:
    """Bytes of the starts a nest's levels beyond the outermost store as it runs again
    (none for the innermost segments, whose steps keep their internal states)."""
    return sum(k * _start(levels[d + 1 :], c, c1) for d, k in enumerate(levels[1:-1], 1))


def _piece_peak(levels: tuple[int, ...], c: int, r: int, c1: int) -> int:
    if len(levels) == 1:
        # A segment of one step: its internal state is the step's in flight.
        return levels[0] * r if levels[0] > 1 else 0
    return levels[0] * _start(levels[1:], c, c1) + _piece_peak(levels[1:], c, r, c1)


def _trips(n: int) -> int:
    """Iterations a loop of ``n`` trips costs beyond its steps: none for one trip, which
    XLA inlines (a segment of one step is straight-line code)."""
    return n if n > 1 else 0


def _piece_iterations(levels: tuple[int, ...]) -> int:
    steps = math.prod(levels)
    if len(levels) == 1:
        return 2 * _trips(steps)
    unit = math.prod(levels[1:])
    return levels[0] * _trips(unit) + levels[0] + levels[0] * _segment_iterations(levels[1:])


def _segment_iterations(levels: tuple[int, ...]) -> int:
    if len(levels) == 1:
        return 2 * _trips(levels[0])  # the VJP's forward and backward loops
    sub = math.prod(levels[1:])
    return (levels[0] - 1) * (_trips(sub) + 1) + levels[0] * (1 + _segment_iterations(levels[1:]))


def _piece_starts(levels: tuple[int, ...]) -> int:
    """Loops a piece starts, each of more than one trip (`_trips`)."""
    if len(levels) == 1:
        return 2 if levels[0] > 1 else 0  # the VJP's forward and backward loops
    *ks, inner = levels
    innermost = math.prod(ks)

    def runs(d: int) -> int:  # whether a segment of level d runs as a loop
        return 1 if math.prod(levels[d + 1 :]) > 1 else 0

    # Entering a segment of level d - 1 from its end runs its K_d - 1 sub-segments again.
    refills = sum(math.prod(ks[:d]) * (ks[d] - 1) * runs(d) for d in range(1, len(ks)))
    # Forward: the loop over outer segments and each one's; backward: the loop over the
    # innermost segments, and in each the VJP's two loops and one refill loop per level
    # below the outermost.
    vjp = 2 if inner > 1 else 0
    return 1 + ks[0] * runs(0) + 1 + innermost * (vjp + len(ks) - 1) + refills


def _nest_pieces(steps: int, inner: tuple[int, ...]) -> list[tuple[int, ...]]:
    """``steps`` steps as whole outer segments of ``inner`` levels, and the remainder as
    nests of the levels below (down to one piece stored whole)."""
    if steps == 0:
        return []
    if not inner:
        return [(steps,)]
    unit = math.prod(inner)
    k = steps // unit
    head = [_drop_ones((k, *inner))] if k else []
    return head + _nest_pieces(steps - k * unit, inner[1:])


def _fuse_last(pieces: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The last piece's last segment run by the forward pass as a nest of its own, down
    to a last innermost segment whose internal states the forward pass keeps: the
    backward pass starts there without running it again."""
    if not pieces or len(pieces[-1]) == 1:
        return pieces
    *head, last = pieces
    rest = [(last[0] - 1, *last[1:])] if last[0] > 1 else []
    return [_drop_ones(p) for p in head + rest] + _fuse_last([_drop_ones(last[1:])])


def _drop_ones(levels: tuple[int, ...]) -> tuple[int, ...]:
    """Inner levels of one segment add a stored carry and nothing else."""
    if len(levels) < 2:
        return levels
    return levels[:1] + tuple(k for k in levels[1:-1] if k > 1) + levels[-1:]


def static_plan(
    num_steps: int,
    levels: tuple[int, ...],
    *,
    carry_bytes: int,
    residual_bytes: int,
    stream_bytes: int = 0,
) -> StaticPlan:
    """The static plan of ``num_steps`` steps in segments of ``levels[1:]``: whole outer
    segments of ``math.prod(levels[1:])`` steps, the rest as smaller nests.

    ``levels[0]`` is ignored but for its count: ``levels=(0, L)`` is nested segments of
    ``L`` steps; ``(0, K, L)`` three levels; ``(num_steps,)`` keeps every step.
    """
    if num_steps < 1:
        raise ValueError(f"memento.planning.static_plan: num_steps={num_steps} is not >= 1.")
    if any(k < 1 for k in levels[1:]):
        raise ValueError(f"memento.planning.static_plan: levels {levels} must be >= 1.")
    pieces = _fuse_last(_nest_pieces(num_steps, tuple(levels[1:])))
    return StaticPlan(tuple(pieces), carry_bytes, residual_bytes, stream_bytes)


def _candidates(num_steps: int, depth: int, c: int, r: int) -> list[tuple[int, ...]]:
    """Inner levels ``(K_2, ..., L)`` worth trying for a nest of ``depth`` levels: the
    balanced split (each level's stored bytes equal) and its neighbours."""
    if depth == 1:
        return [()]
    out = set()
    # Balanced: K_i * c equal at every outer level and L * r the same.
    ratio = c / max(r, 1)
    for scale in np.geomspace(0.25, 4.0, 13):
        k = max(1.0, (num_steps * ratio ** (depth - 1)) ** (1.0 / depth))  # K per level
        inner_len = max(1, round(scale * k / ratio))
        mids = []
        rest = num_steps / inner_len
        for level in range(depth - 2):
            kk = max(1, round(rest ** (1.0 / (depth - 1 - level))))
            mids.append(kk)
            rest /= kk
        out.add((*mids, min(inner_len, num_steps)))
        out.update(_exact_mids(num_steps, tuple(mids), min(inner_len, num_steps)))
    if depth == 2:  # beside stored steps the best segment is longer: try every scale
        out.update((int(n),) for n in np.unique(np.geomspace(1, num_steps, 40).astype(int)))
        # Divisors near the balanced length: one nest, no remainder (the fewest loops).
        balanced = math.sqrt(num_steps * ratio)
        out.update((d,) for d in _near_divisors(num_steps, balanced, 4))
    return sorted(out)


def _exact_mids(num_steps: int, mids: tuple[int, ...], inner_len: int) -> list[tuple[int, ...]]:
    """Inner levels ``(*mids', inner_len)`` whose product divides ``num_steps``, each of
    ``mids'`` within a factor 2 of ``mids``: one nest, no remainder nest beside it (whose
    loops' state and refilled starts a tight budget may not hold)."""
    if not mids or num_steps % inner_len:
        return []
    outer = num_steps // inner_len
    # Each level's divisors of the segments' count near its balanced size.
    near = [_near_divisors(outer, k, 2) for k in mids]
    out = []
    for combo in itertools.product(*near):
        if outer % math.prod(combo) == 0:
            out.append((*combo, inner_len))
    return out


def _near_divisors(n: int, k: float, factor: float) -> list[int]:
    """The divisors of ``n`` within ``factor`` of ``k``."""
    return [d for d in _divisors(n) if k / factor <= d <= k * factor]


@functools.lru_cache(maxsize=256)
def _divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n`` (none past 10^10 steps: the search takes sqrt(n) tries)."""
    if n > 10**10:
        return ()
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return (*small, *(n // d for d in small))


def plan_static(
    num_steps: int,
    budget_bytes: float,
    *,
    carry_bytes: int,
    residual_bytes: int,
    stream_bytes: int = 0,
    level_bytes: int = 0,
    piece_bytes: int = 0,
    loop_bytes: int = 0,
    start_bytes: int | None = None,
    carry_rewrite_bytes: int = 0,
    residual_rewrite_bytes: int = 0,
    widened_bytes: int = 0,
    fill_bytes: int = 0,
    one_step_bytes: int = 0,
    max_depth: int = 4,
    fewest_bytes: bool = False,
    seconds: Callable[[StaticPlan], float] | None = None,
) -> StaticPlan | None:
    """Every step stored where that fits ``budget_bytes`` (``lax.scan``'s own gradient);
    else the static plan of fewest evaluations (then fewest loop iterations) whose stored
    states fit it, or None if none of up to ``max_depth`` levels fits;
    with ``seconds`` (a plan's predicted time), the fastest that fits, or one of fewer
    loops (`StaticPlan.program_loops`) predicted within 3% of its time; with
    ``fewest_bytes``, the candidate of fewest bytes instead.

    Candidates: every step stored (BPTT); nests of 2 to ``max_depth`` levels balanced for
    the bytes of a carry and of an internal state, and two-level nests of segments
    differing by one step at most (two nests where the length does not divide), the
    longest that fit among them; each ending in its last innermost segment or its last
    step kept by the forward pass; and each nest followed by as many steps stored whole
    as the budget allows (their internal states are freed before the nest's backward
    pass begins, so they cost only beside the nest's outer starts); and each nest as it
    is, its last segment run again by the backward pass (fewer loops).
    """
    c, r, s = max(int(carry_bytes), 1), max(int(residual_bytes), 1), int(stream_bytes)
    c1 = c if start_bytes is None else int(start_bytes)
    sizes = (
        c, r, s, int(level_bytes), int(piece_bytes), int(loop_bytes), c1,
        int(carry_rewrite_bytes), int(residual_rewrite_bytes), int(widened_bytes),
        int(fill_bytes), int(one_step_bytes),
    )  # fmt: skip
    best: StaticPlan | None = None

    fits: dict[StaticPlan, float] = {}  # with ``seconds``: each plan that fits, its time

    def key(p: StaticPlan):
        if fewest_bytes:
            return (p.peak_bytes, p.evaluations)
        return (p.evaluations, p.loop_iterations)

    seen: set[StaticPlan] = set()

    def consider(p: StaticPlan | None) -> None:
        nonlocal best
        if p is None or p in seen:
            return
        seen.add(p)
        if _lone_segment(p) or p.peak_bytes > budget_bytes:
            return
        if seconds is not None:
            fits[p] = seconds(p)
        elif best is None or key(p) < key(best):
            best = p

    def consider_nest(pieces_of: Callable[[int], list[tuple[int, ...]]]) -> None:
        consider(StaticPlan(tuple(pieces_of(num_steps)), *sizes))
        consider(StaticPlan(tuple(_fuse_last(pieces_of(num_steps))), *sizes))
        consider(StaticPlan(tuple(_keep_last_step(pieces_of(num_steps - 1))), *sizes))

    everything = StaticPlan(((num_steps,),), *sizes)
    if not fewest_bytes and everything.peak_bytes <= budget_bytes:
        return everything  # lax.scan's own gradient: the fewest evaluations and loops
    consider(everything)
    whole = num_steps * r
    for depth in range(2, max_depth + 1):
        for inner in _candidates(num_steps, depth, c, r + s):
            # Every plan below stores the starts of about T / prod(inner) segments (two
            # fewer at most), or, with a suffix, as many or all the steps whole; and
            # holds an innermost segment's internal states.
            if inner[-1] > 1 and inner[-1] * r > budget_bytes:
                continue
            starts = max(0, num_steps // math.prod(inner) - 2) * min(c, c1)
            starts += min(0, int(one_step_bytes))  # a one-step segment may count less
            if starts <= budget_bytes:
                consider_nest(functools.partial(_nest_pieces, inner=inner))
                if depth == 2:
                    consider_nest(functools.partial(_even_pieces, length=inner[0]))
            if not fewest_bytes and min(starts, whole) <= budget_bytes:
                consider(_with_suffix(num_steps, inner, budget_bytes, sizes))
    if not fewest_bytes:
        length = _longest_even(num_steps, budget_bytes, sizes)
        consider_nest(functools.partial(_even_pieces, length=length))
    if fits:
        # The fastest, or a plan of fewer loops within SIMPLER of its time: each loop
        # adds to the program that is traced and compiled on the first call.
        fastest = min(fits.values())
        return min(
            (p for p, t in fits.items() if t <= fastest * (1 + SIMPLER)),
            key=lambda p: (p.program_loops, fits[p], p.evaluations, p.loop_iterations),
        )
    return best


def _lone_segment(plan: StaticPlan) -> bool:
    """Whether a plan of several pieces has a nest of one outer segment. XLA was seen to
    keep the other pieces' buffers alive beside that segment's run again (its loop of one
    trip is inlined), beyond what `StaticPlan.peak_bytes` counts: such plans are not
    considered."""
    return len(plan.pieces) > 1 and any(len(p) > 1 and p[0] == 1 for p in plan.pieces)


def _keep_last_step(pieces: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """``pieces`` followed by one more step stored whole: the forward pass keeps the last
    step's internal state (a nest's last segment runs again in the backward pass)."""
    if pieces and len(pieces[-1]) == 1:
        return [*pieces[:-1], (pieces[-1][0] + 1,)]
    return [*pieces, (1,)]


def _even_pieces(num_steps: int, length: int) -> list[tuple[int, ...]]:
    """``num_steps`` steps as the fewest segments of at most ``length`` steps, their
    lengths differing by one at most: two nests of two levels (one where they divide)."""
    if num_steps < 1:
        return []
    count = -(-num_steps // max(1, min(length, num_steps)))
    short, longer = divmod(num_steps, count)
    pieces = [(longer, short + 1), (count - longer, short)]
    return [_drop_ones(p) for p in pieces if p[0] and p[1]]


def _longest_even(num_steps: int, budget: float, sizes) -> int:
    """The longest segments whose `_even_pieces`, the last step kept, fit ``budget`` (the
    fewest segments, so the fewest loops), searched above the length of fewest bytes."""

    def fits(length: int) -> bool:
        pieces = _keep_last_step(_even_pieces(num_steps - 1, length))
        return StaticPlan(tuple(pieces), *sizes).peak_bytes <= budget

    c, r, s = sizes[:3]
    lo, hi = max(1, min(num_steps, math.isqrt(num_steps * c // max(r + s, 1)))), num_steps
    if not fits(lo):
        return lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _with_suffix(num_steps: int, inner: tuple[int, ...], budget: float, sizes):
    """Whole outer segments of ``inner`` levels, then the rest stored whole: the fewest
    outer segments that fit ``budget`` (the peak falls as segments replace stored
    steps), or None."""
    unit = math.prod(inner)

    def plan(k: int) -> StaticPlan:
        head = [_drop_ones((k, *inner))] if k else []
        tail = [(num_steps - k * unit,)] if num_steps > k * unit else []
        return StaticPlan(tuple(_fuse_last(head + tail)), *sizes)

    lo, hi = 0, num_steps // unit
    if plan(hi).peak_bytes > budget:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if plan(mid).peak_bytes <= budget:
            hi = mid
        else:
            lo = mid + 1
    if lo == 1 and num_steps // unit >= 2:
        lo = 2  # one segment is a lone segment (`_lone_segment`); two fit if one does
    return plan(lo)


def nest_schedule(plan: StaticPlan) -> Schedule:
    """``plan`` as schedule rows, to replay with `Schedule.simulate`.

    The rows are what the static executor runs (``h_0`` is the caller's, not counted):
    each nest piece stores its start and the
    starts of its outer segments 2..K; a segment's backward stores the starts of its
    sub-segments 2..K and takes the first's from its parent. Slots are counted as the
    schedule model counts them: a carry takes one, an internal state
    ``alpha = ceil(residual_bytes / carry_bytes)``; ``memory`` is the replayed peak.
    """
    rows: list[tuple[int, int, int]] = []
    free: list[int] = []
    top = [0]

    def take() -> int:
        if free:
            return free.pop()
        top[0] += 1
        return top[0] - 1

    def save_hidden(pos: int) -> int:
        j = take()
        rows.append((int(Op.SAVE_HIDDEN), j, pos))
        return j

    def release(j: int, pos: int) -> None:
        if j >= 0:
            rows.append((int(Op.FREE_HIDDEN), j, pos))
            free.append(j)

    def advance(pos: int, n: int) -> None:
        if n:
            rows.append((int(Op.ADVANCE), n, pos))

    def save_internals(pos: int, n: int) -> list[int]:
        slots = [take() for _ in range(n)]
        for p, j in zip(range(pos, pos + n), slots):
            rows.append((int(Op.SAVE_INTERNAL), j, p))
        return slots

    def backward_internals(pos: int, slots: list[int]) -> None:
        for p, j in reversed(list(zip(range(pos, pos + len(slots)), slots))):
            rows.append((int(Op.BACKWARD_INTERNAL), j, p))
            rows.append((int(Op.FREE_INTERNAL), j, p))
            free.append(j)

    def forward_starts(pos: int, levels: tuple[int, ...]) -> list[int]:
        """From ``h_pos``, store the starts of segments 2..K (and stop at the last)."""
        unit = math.prod(levels[1:])
        starts = []
        for i in range(1, levels[0]):
            advance(pos + (i - 1) * unit, unit)
            starts.append(save_hidden(pos + i * unit))
        return starts

    def backward_segments(pos: int, levels: tuple[int, ...], first: int, starts: list[int]):
        unit = math.prod(levels[1:])
        for i in reversed(range(levels[0])):
            p, held = pos + i * unit, first if i == 0 else starts[i - 1]
            rows.append((int(Op.LOAD_HIDDEN), held, p))
            segment_backward(p, levels[1:], held)
            if i:
                release(held, p)

    def segment_backward(pos: int, levels: tuple[int, ...], held: int) -> None:
        """Back-propagate a segment whose start ``h_pos`` is the current state, held in
        slot ``held``."""
        if len(levels) == 1:
            backward_internals(pos, save_internals(pos, levels[0]))
        else:
            backward_segments(pos, levels, held, forward_starts(pos, levels))

    pos, kept = 0, []
    for levels in plan.pieces:  # the forward pass
        n = math.prod(levels)
        if len(levels) == 1:
            kept.append((pos, levels, -1, save_internals(pos, n)))
        else:
            first = save_hidden(pos) if pos else INITIAL
            starts = forward_starts(pos, levels)
            unit = math.prod(levels[1:])
            advance(pos + (levels[0] - 1) * unit, unit)
            kept.append((pos, levels, first, starts))
        pos += n
    for start, levels, first, slots in reversed(kept):  # the backward pass
        if len(levels) == 1:
            backward_internals(start, slots)
        else:
            backward_segments(start, levels, first, slots)
            release(first, start)
    alpha = max(1, -(-plan.residual_bytes // max(plan.carry_bytes, 1)))
    schedule = Schedule(
        num_steps=plan.num_steps,
        memory=2**62,
        policy="static",
        cost=plan.evaluations,
        actions=np.asarray(rows, dtype=np.int64).reshape(-1, 3),
        alpha=alpha,
        beta=alpha,
        counts_initial=False,  # h_0 is the caller's: the executor never stores it
    )
    return dataclasses.replace(schedule, memory=schedule.simulate().peak_memory)
