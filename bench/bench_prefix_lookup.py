"""What hashed blocks cost beside a token-granular radix tree: the prefix cache's lookup per
prompt, and the forward time of the partial last block a warm turn computes again.

    python bench/bench_prefix_lookup.py [--bundle build/smollm2-4k.dsmodel]

1. Keys and lookup: a prompt's block keys (SHA-256 chain) and its longest cached run, for
   prompts of 500, 1300 and 2800 tokens, all cached (the worst case: every key found).
2. The partial block: a warm turn feeds its new tokens (the last reply and the question,
   here 40) after a cached prefix; a radix tree would also spare the prefix's last partial
   block, 0-15 tokens (8 on average). Timed: forwards of 40 and of 48 new tokens after 1300
   cached ones, interleaved, median of --repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def lookup_us(engine, tokens: int, repeats: int) -> float:
    from dspark.runtime.sequence.request import GenerationRequest

    prompt = [int(t) % 40000 + 100 for t in range(7, 7 + tokens)]
    engine.generate([GenerationRequest(tuple(prompt), 1, speculative=False)])  # cache it
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        found = engine.kv.prefix.find(prompt, [])
        times.append(time.perf_counter() - t0)
    assert found.positions["main"] >= tokens - 2 * engine.arena.block_size
    return 1e6 * statistics.median(times)


def forward_ms(engine, cached: int, new: int, repeats: int) -> list[float]:
    """Median ms of a forward of `new` tokens after `cached` ones, for each of `new`."""
    arena, main = engine.arena, engine.main
    arena.add_sequence(-1)
    times: dict[int, list[float]] = {n: [] for n in new}
    try:
        main.forward([(-1, 0, [5] * cached)], [0])
        for _ in range(repeats):
            for n in new:
                t0 = time.perf_counter()
                main.forward([(-1, cached, [7] * n)], [1])
                times[n].append(time.perf_counter() - t0)
                arena.rollback(-1, "main", cached)
    finally:
        arena.release(-1)
    return [1000 * statistics.median(times[n]) for n in new]


def main() -> None:
    from bench_peers import cpu_line
    from revision import revision

    from dspark.runtime.engine.loader import load_engine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, default=ROOT / "build" / "smollm2-4k.dsmodel")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    measured = revision()
    engine, _ = load_engine(args.bundle, watch=False)
    lookups = {n: lookup_us(engine, n, args.repeats) for n in (500, 1300, 2800)}
    full, partial = forward_ms(engine, 1300, (40, 48), args.repeats)
    report = {"cpu": cpu_line(), "revision": measured, "lookup_us": lookups,
              "forward_ms": {"40": full, "48": partial}}
    print("\n".join([report["cpu"], *table(report)]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


def table(report: dict) -> list[str]:
    full, partial = report["forward_ms"]["40"], report["forward_ms"]["48"]
    return ["| what | cost |", "|---|---|", *(
        f"| keys and look-up, {n}-token prompt, every block cached | {us:.0f} us |"
        for n, us in report["lookup_us"].items()),
        f"| forward of 40 new tokens after 1300 cached | {full:.1f} ms |",
        f"| forward of 48 new tokens after 1300 cached | {partial:.1f} ms |",
        f"| the average partial block (8 tokens) a block-granular cache computes again | "
        f"{partial - full:.1f} ms ({(partial - full) / full:.0%}) |"]


if __name__ == "__main__":
    main()
