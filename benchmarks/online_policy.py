"""memento.while_loop's online checkpointing against the offline optimum, every n.

For c slots and every loop length n, the forward evaluations of the online policy
(checkpoints placed while the loop runs, the rest planned once n is known; replayed by
`memento.planning.online_evaluations`, which a test checks against the executor's
counted evaluations) divided by the offline optimum ``memento.plan(n, c, policy="hsm").cost``.

    python benchmarks/online_policy.py [--max-steps 10000] [--slots 8 16 30]

Writes benchmarks/results/online_policy.json.
"""

import argparse
import json
import time
from pathlib import Path

from memento import planning


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=10_000)
    parser.add_argument("--slots", type=int, nargs="+", default=[8, 16, 30])
    args = parser.parse_args()
    rows = []
    for c in args.slots:
        start = time.perf_counter()
        ratios = {
            n: planning.online_evaluations(c, n, args.max_steps) / planning.hsm_cost(n, c)
            for n in range(1, args.max_steps + 1)
        }
        for lo in (1, 10, 20):
            n_worst = max((n for n in ratios if n >= lo), key=ratios.__getitem__)
            rows.append(
                {
                    "slots": c,
                    "n_from": lo,
                    "worst_ratio": round(ratios[n_worst], 4),
                    "at_n": n_worst,
                }
            )
        mean = sum(ratios.values()) / len(ratios)
        print(f"c={c:3d}: mean ratio {mean:.4f} over n=1..{args.max_steps} "
              f"({time.perf_counter() - start:.1f} s)")  # fmt: skip
    print("\n| slots | n from | worst ratio to offline optimum | at n |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['slots']} | {r['n_from']} | {r['worst_ratio']:.3f} | {r['at_n']} |")
    out = Path(__file__).parent / "results" / "online_policy.json"
    out.write_text(json.dumps({"max_steps": args.max_steps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
