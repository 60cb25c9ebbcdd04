"""Reading compiled programs: which collectives run inside loops.

Used by the multi-device tests and ``benchmarks/sharded.py`` to check that memento's
loops add no collective to those of ``lax.scan`` (issue: stored states keep their
sharding). Text only: no JAX import.
"""

from __future__ import annotations

import re

KINDS = ("all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter")


def loop_collectives(hlo: str) -> dict[str, list[str]]:
    """The collectives inside while-loop bodies of ``hlo`` (``compiled.as_text()``) and of
    the computations they call, by kind: a list of result types such as ``"f64[256,16]"``."""
    comps, cur = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if m and not line.startswith(" "):
            cur = m.group(1)
            comps[cur] = []
        elif cur is not None:
            comps[cur].append(line)
    called = {
        c: set(re.findall(r"(?:body|condition|to_apply|calls)=%?([\w.\-]+)", "\n".join(ls)))
        | {x for b in re.findall(r"branch_computations=\{([^}]*)\}", "\n".join(ls))
           for x in re.findall(r"%?([\w.\-]+)", b)}
        for c, ls in comps.items()
    }  # fmt: skip
    todo = [m for ls in comps.values() for l in ls for m in re.findall(r"body=%?([\w.\-]+)", l)]
    seen = set()
    while todo:
        c = todo.pop()
        if c not in seen and c in comps:
            seen.add(c)
            todo.extend(called[c])
    # each collective by its result type: "f64[256,16]" (layouts dropped)
    return {
        k: [
            re.sub(r"\{[\d,]*\}", "", l.split("=", 1)[1].split()[0])
            for c in seen
            for l in comps[c]
            if re.search(rf"\b{k}(-start)?\(", l)
        ]
        for k in KINDS
    }
