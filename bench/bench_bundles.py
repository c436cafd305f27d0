"""A/B of compiled bundles: one model's decode and verify step, interleaved in one process.

    python bench/bench_bundles.py build/a.dsmodel build/b.dsmodel [--role main]
        [--context 100] [--verify 5] [--repeats 40] [--mapped-groups]

Each bundle's model runs a 1-token decode step and a k-token verify step at a cached
context, the bundles taking turns, so a compiler change is measured under the same machine
conditions (this VM drifts 10-30% over minutes). Prints median ms per step, the ratio to
the first bundle and each bundle's verify/decode ratio. Runs with glibc's huge-page tunable,
as dsrun does: without it the first model loaded measured 24% slower than an identical second.
`--mapped-groups`: each bundle's model also with its packed int4 groups left to onnxruntime,
which maps them from the bundle's file (page-cache pages), beside the runtime's own read into
huge-page-backed memory (runtime/model/fused.py's packed_groups): does either step faster?
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
    p.add_argument("--mapped-groups", action="store_true",
                   help="each bundle's int4 groups also mapped from its file, beside the read")
    args = p.parse_args()
    with_hugepages()
    from dspark.runtime.model.sessions import init_threads

    init_threads()
    import dspark.runtime.model.fused as fused
    from dspark.runtime.bundle.bundle import open_bundle
    from dspark.runtime.cache.kv_arena import KVArena
    from dspark.runtime.model.runner import ModelRunner

    runners, labels, read = [], [], fused.packed_groups
    for path in args.bundles:
        bundle = open_bundle(path)
        for mapped in (False, True) if args.mapped_groups else (False,):
            if mapped and bundle.model(args.role).int4_graph_file is None:
                raise SystemExit(f"{path}: the {args.role} model has no packed int4 groups")
            # mapped: no groups handed over, so onnxruntime maps them from the bundle's file
            fused.packed_groups = (lambda bundle, role: {}) if mapped else read
            try:
                arena = KVArena(bundle.plan)
                runner = ModelRunner(bundle, args.role, arena)
            finally:
                fused.packed_groups = read
            arena.add_sequence(1)
            runner.forward([(1, 0, list(range(5, 5 + args.context)))], [1])
            runners.append(runner)
            labels.append(f"{path} (mapped)" if mapped else str(path))
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
    for i, label in enumerate(labels):
        cells = "  ".join(f"{n} tok {med[(i, n)]:6.2f} ms ({med[(0, n)] / med[(i, n)]:.3f}x)"
                          for n in sizes)
        print(f"  {label:<36} {cells}  verify/decode {med[(i, sizes[1])] / med[(i, 1)]:.3f}")


if __name__ == "__main__":
    main()
