"""TAS: a short tenant's time to first token, alone and next to a tenant with long prompts.

Tenant "big" sends prompts of --long tokens; tenant "small" sends prompts of --short
tokens, one at a time, arriving while the long prompts are being fed and decoded. Prints the
small tenant's median TTFT alone and shared, and their ratio (the seed's case: 2000 and 50).

    python samples/bench_tenants.py --bundle build/smollm2.dsmodel [--long 2000] [--short 50]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def small_ttfts(engine, short: list[int], n: int, with_big: list[int] | None) -> list[float]:
    from dspark.runtime.sequence.request import GenerationRequest

    if with_big is not None:
        for _ in range(2):
            engine.submit(GenerationRequest(tuple(with_big), 32, tenant="big"))
    out = []
    for i in range(n):
        for _ in range(2 + i):  # arrive at different points of the long requests' life
            if engine.busy:
                engine.step()
        seq = engine.submit(GenerationRequest(tuple(short), 8, tenant="small"))
        while seq.first_token_at is None:
            engine.step()
        out.append(seq.first_token_at - seq.submitted)
    while engine.busy:
        engine.step()
    return out


def main() -> None:
    from dspark.runtime.engine.loader import load_engine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, default=Path("build/smollm2.dsmodel"))
    p.add_argument("--long", type=int, default=2000)
    p.add_argument("--short", type=int, default=50)
    p.add_argument("--requests", type=int, default=6)
    args = p.parse_args()
    engine, _ = load_engine(args.bundle)
    engine.eos_ids = frozenset()
    long_prompt = [(17 * i) % 4000 + 100 for i in range(args.long)]
    short_prompt = [(31 * i) % 4000 + 100 for i in range(args.short)]
    small_ttfts(engine, short_prompt, 2, None)  # warm-up
    alone = small_ttfts(engine, short_prompt, args.requests, None)
    t0 = time.perf_counter()
    shared = small_ttfts(engine, short_prompt, args.requests, long_prompt)
    a, s = statistics.median(alone) * 1000, statistics.median(shared) * 1000
    print(f"small tenant ({args.short}-token prompts) TTFT: alone {a:.0f} ms, next to "
          f"{args.long}-token prompts {s:.0f} ms (ratio {s / a:.2f}; max shared "
          f"{max(shared) * 1000:.0f} ms; prompt chunks "
          f"{engine.config.scheduling.prefill_chunk_tokens} tokens alone, "
          f"{engine.config.scheduling.shared_prefill_chunk_tokens} shared; run "
          f"{time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
