"""VLB under load: aggregate tokens/s of N concurrent requests, steady-lane settings compared.

Runs the shipped bench prompts as one batch of N concurrent requests (N from --concurrency),
speculative at a fixed window, for each verify-balance setting, interleaved, and prints
aggregate tokens/s and the mean verified window; plain decoding is the reference.

    python bench/bench_vlb.py --bundle build/smollm2.dsmodel [--concurrency 1,8] [--window 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

SETTINGS = {  # name: (low_utilisation, high_utilisation, steady_tokens_low, steady_tokens_mid)
    "seed 2/1": (0.60, 0.85, 2, 1),
    "wide 8/8": (0.60, 0.85, 8, 8),
    "wide 8/2": (0.60, 0.85, 8, 2),
}


def run(engine, prompts, n: int, tokens: int, speculative: bool) -> tuple[float, float]:
    from dspark.runtime.sequence.request import GenerationRequest

    batch = [prompts[i % len(prompts)] for i in range(n)]
    t0 = time.perf_counter()
    seqs = engine.generate([GenerationRequest(tuple(p), tokens, speculative=speculative,
                                              method="draft") for p in batch])
    elapsed = time.perf_counter() - t0
    rounds = sum(s.stats.rounds for s in seqs)
    window = sum(s.stats.windows for s in seqs) / rounds if rounds else 0.0
    return sum(len(s.generated) for s in seqs) / elapsed, window


def main() -> None:
    from dspark.runtime.bundle.config import VerifyBalanceConfig
    from dspark.runtime.engine.loader import load_engine
    from dspark.runtime.sequence.prompt import entry_ids, load_prompts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, default=Path("build/smollm2.dsmodel"))
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    engine, tokenizer = load_engine(args.bundle, args.window, max_batch=64)
    engine.eos_ids = frozenset()
    prompts = [entry_ids(tokenizer, x) for x in load_prompts(None)]
    run(engine, prompts, 2, 8, True)
    for n in (int(x) for x in args.concurrency.split(",")):
        results: dict[str, list] = {}
        for _ in range(args.repeats):
            results.setdefault("plain", []).append(run(engine, prompts, n, args.tokens, False))
            for name, (lo, hi, steady, mid) in SETTINGS.items():
                engine.balancer.config = VerifyBalanceConfig(lo, hi, steady, mid)
                results.setdefault(name, []).append(run(engine, prompts, n, args.tokens, True))
        engine.balancer.config = replace(engine.config.verify_balance)
        plain = statistics.median(r[0] for r in results["plain"])
        print(f"concurrency {n}, window {args.window}, {args.tokens} tokens each:")
        for name, rs in results.items():
            tps = statistics.median(r[0] for r in rs)
            print(f"  {name:<9} {tps:7.1f} tok/s  {tps / plain:5.2f}x  mean verified window "
                  f"{statistics.median(r[1] for r in rs):.2f}  utilisation "
                  f"{engine.balancer.utilisation:.2f}")


if __name__ == "__main__":
    main()
