"""Meta-gradients: memento's mixed mode (MixFlow-MG) against JAX's default autodiff.

Parts (MixFlow-MG): 1. the toy task (Eq. 9) over M, scan and unrolled; 2. the three
bilevel tasks on a small transformer across sizes; 3. static memory against the number
of inner steps T, with a `memento.scan` budget. Writes benchmarks/results/metagrad.json
and prints Markdown tables. Never run by pytest.

    python benchmarks/metagrad.py [--quick] [--parts toy,tasks,memory] [--json PATH]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memento_bench import metagrad as _bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sweeps")
    parser.add_argument("--parts", default="toy,tasks,memory")
    parser.add_argument("--json", default="benchmarks/results/metagrad.json")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    parts = args.parts.split(",")
    results, tables = {}, []

    def log(line):
        print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)

    if "toy" in parts:
        results["toy"] = _bench.toy_rows(args.quick, args.repeats, log)
        tables.append(
            ("Toy task (Eq. 9), B=256, D=512, T=2", results["toy"], ("variant", "M", "impl"))
        )
        _bench.write_json(args.json, results)
    if "tasks" in parts:
        results["tasks"] = _bench.task_rows(args.quick, args.repeats, log)
        keys = ("task", "params", "num_layers", "seq_len", "batch", "num_steps", "impl")
        tables.append(("Transformer tasks", results["tasks"], keys))
        _bench.write_json(args.json, results)
    if "memory" in parts:
        results["memory"] = _bench.memory_rows(args.quick, min(args.repeats, 3), log=log)
        tables.append(
            (
                "Memory against T (SGD, toy map M=4)",
                results["memory"],
                ("T", "impl", "param_copies"),
            )
        )
        _bench.write_json(args.json, results)
    for title, rows, keys in tables:
        print(f"\n### {title}\n")
        print(_bench.markdown(rows, keys))


if __name__ == "__main__":
    main()
