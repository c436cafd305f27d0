"""A/B of compiled bundles: one model's decode and verify step, interleaved in one process.

    python bench/bench_bundles.py build/a.dsmodel build/b.dsmodel [--role main]
        [--context 100] [--verify 5] [--repeats 40]

Each bundle's model runs a 1-token decode step and a k-token verify step at a cached
context, the bundles taking turns, so a compiler change is measured under the same machine
conditions (this VM drifts 10-30% over minutes). Prints median ms per step, the ratio to
the first bundle and each bundle's verify/decode ratio. Runs with glibc's huge-page tunable,
as dsrun does: without it the first model loaded measured 24% slower than an identical second.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from dspark.runtime.cli.util import with_hugepages


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundles", type=Path, nargs="+")
    p.add_argument("--role", default="main")
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--verify", type=int, default=5)
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args()
    with_hugepages()
    from dspark.runtime.model.sessions import init_threads

    init_threads()
    from dspark.runtime.bundle.bundle import open_bundle
    from dspark.runtime.cache.kv_arena import KVArena
    from dspark.runtime.model.runner import ModelRunner

    runners = []
    for path in args.bundles:
        bundle = open_bundle(path)
        arena = KVArena(bundle.plan)
        runner = ModelRunner(bundle, args.role, arena)
        arena.add_sequence(1)
        runner.forward([(1, 0, list(range(5, 5 + args.context)))], [1])
        runners.append(runner)
    sizes = (1, args.verify)
    times = {(i, n): [] for i in range(len(runners)) for n in sizes}
    for _ in range(args.repeats):
        for i, runner in enumerate(runners):
            for n in sizes:
                t0 = time.perf_counter()
                runner.forward([(1, args.context, list(range(7, 7 + n)))], [n])
                times[(i, n)].append(time.perf_counter() - t0)
                runner.arena.rollback(1, runner.pool, args.context)
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    print(f"{args.role}, context {args.context}, median of {args.repeats} interleaved")
    for i, path in enumerate(args.bundles):
        cells = "  ".join(f"{n} tok {med[(i, n)]:6.2f} ms ({med[(0, n)] / med[(i, n)]:.3f}x)"
                          for n in sizes)
        print(f"  {str(path):<36} {cells}  verify/decode {med[(i, sizes[1])] / med[(i, 1)]:.3f}")


if __name__ == "__main__":
    main()
