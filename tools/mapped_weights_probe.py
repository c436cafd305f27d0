"""Does a fused session step as fast reading its packed int4 groups from the bundle's file
(onnxruntime maps int4.bin: page-cache pages) as from our memory (runtime/model/fused.py's
packed_groups: read into anonymous, huge-page-backed buffers, handed over without a copy)?

    python tools/mapped_weights_probe.py [--bundle build/smollm2-q4.dsmodel] [--role main]
        [--context 100] [--verify 5] [--repeats 40]

Both sessions run in one process, the same graph and arithmetic, taking turns per step: a
1-token decode and a k-token verify at a cached context. Prints median ms per step and
mapped / in memory. Runs with glibc's huge-page tunable, as dsrun does.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from dspark.runtime.cli.util import with_hugepages


def runners(bundle_path: Path, role: str):
    """(mapped, in memory): two ModelRunners of `role`, each over its own arena."""
    import dspark.runtime.model.fused as fused
    from dspark.runtime.bundle.bundle import open_bundle
    from dspark.runtime.cache.kv_arena import KVArena
    from dspark.runtime.model.runner import ModelRunner

    bundle = open_bundle(bundle_path)
    if bundle.model(role).int4_graph_file is None:
        raise SystemExit(f"{bundle_path}: the {role} model has no packed int4 projections")
    out = []
    read = fused.packed_groups
    for mapped in (True, False):
        # mapped: no groups handed over, so onnxruntime maps them from the bundle's file
        fused.packed_groups = (lambda bundle, role: {}) if mapped else read
        try:
            out.append(ModelRunner(bundle, role, KVArena(bundle.plan)))
        finally:
            fused.packed_groups = read
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, default=Path("build/smollm2-q4.dsmodel"))
    p.add_argument("--role", default="main")
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--verify", type=int, default=5)
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args()
    with_hugepages()
    from dspark.runtime.model.device import cpu_line
    from dspark.runtime.model.sessions import init_threads

    init_threads()
    pair = runners(args.bundle, args.role)
    for runner in pair:
        runner.arena.add_sequence(1)
        runner.forward([(1, 0, list(range(5, 5 + args.context)))], [1])
    sizes = (1, args.verify)
    times = {(i, n): [] for i in range(2) for n in sizes}
    for _ in range(args.repeats):
        for i, runner in enumerate(pair):
            for n in sizes:
                t0 = time.perf_counter()
                runner.forward([(1, args.context, list(range(7, 7 + n)))], [n])
                times[(i, n)].append(time.perf_counter() - t0)
                runner.arena.rollback(1, runner.pool, args.context)
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    print(cpu_line())
    print(f"{args.bundle} {args.role}, context {args.context}, median of {args.repeats} "
          "interleaved")
    for n in sizes:
        print(f"{n} tok: mapped {med[(0, n)]:6.2f} ms, in memory {med[(1, n)]:6.2f} ms, "
              f"mapped / in memory {med[(0, n)] / med[(1, n)]:.3f}")


if __name__ == "__main__":
    main()
