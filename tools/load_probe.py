"""In-process load probe: N requests kept running on one engine (a finished one replaced at
once), plain against default speculation, for a quick look at what the step loop does
under load (no HTTP; bench/bench_serving.py is the benchmark).

    python tools/load_probe.py --bundle build/smollm2-q4.dsmodel --clients 1,4,16

Per setting: tokens/s, TTFT p50/p99 (submission to first token, in steps' time), per
request mean ITL p50/p99, and how the steps went: mean batch, share of steps that drafted,
drafts verified and accepted per drafting step.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(engine, tok, prompts: list[str], clients: int, seconds: float, spec: bool,
        max_tokens: int, seed: int) -> dict:
    from dspark.runtime.sequence.request import GenerationRequest

    rng = random.Random(seed)
    live, done, steps = [], [], []

    def submit() -> None:
        ids = tuple(tok.encode_chat([{"role": "user", "content": rng.choice(prompts)}]))
        live.append(engine.submit(GenerationRequest(ids, max_tokens, speculative=spec,
                                                    cache_prompt=False)))
    for _ in range(clients):
        submit()
    end = time.perf_counter() + seconds
    emitted: dict[int, list[float]] = {}
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        report = engine.step()
        now = time.perf_counter()
        steps.append((len(report.advanced), sum(r.drafted for r in report.rounds),
                      sum(r.accepted for r in report.rounds), now - t0))
        for seq in report.advanced:
            emitted.setdefault(seq.id, []).append(now)
        for seq in [s for s in live if s.done]:
            live.remove(seq)
            done.append(seq)
            submit()
    for seq in live:
        engine.cancel(seq)
    ttft = [1000 * s.ttft_s for s in done if s.ttft_s is not None]
    itl = [1000 * (emitted[s.id][-1] - s.first_token_at) / (len(s.generated) - 1)
           for s in done if len(s.generated) > 1 and s.id in emitted]
    drafting = [s for s in steps if s[1]]
    return {"clients": clients, "speculative": spec,
            "tokens_per_s": sum(len(s.generated) for s in done) / seconds,
            "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "itl_p50": percentile(itl, 0.5), "itl_p99": percentile(itl, 0.99),
            "mean_batch": sum(s[0] for s in steps) / max(1, len(steps)),
            "drafting_steps": len(drafting) / max(1, len(steps)),
            "drafted_per_step": sum(s[1] for s in drafting) / max(1, len(drafting)),
            "accepted_per_step": sum(s[2] for s in drafting) / max(1, len(drafting))}


def main() -> None:
    from dspark.runtime.engine.loader import load_engine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, default=ROOT / "build" / "smollm2-q4.dsmodel")
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    engine, tok = load_engine(args.bundle, watch=False)
    prompts = [json.loads(line)["chat"] for line in
               (ROOT / "samples" / "prompts" / "peer_prompts.jsonl").read_text().splitlines()]
    for clients in (int(c) for c in args.clients.split(",")):
        for spec in (False, True):
            r = run(engine, tok, prompts, clients, args.seconds, spec, args.max_tokens, 0)
            print(f"{clients:>3} {'default' if spec else 'plain  '} {r['tokens_per_s']:6.1f} "
                  f"tok/s  TTFT {r['ttft_p50']:6.0f}/{r['ttft_p99']:6.0f}  ITL "
                  f"{r['itl_p50']:5.1f}/{r['itl_p99']:5.1f}  batch {r['mean_batch']:.1f}  "
                  f"drafting {r['drafting_steps']:.0%} of steps, {r['drafted_per_step']:.1f} "
                  f"drafted {r['accepted_per_step']:.1f} kept a step; modes "
                  f"{engine.balancer.modes.summary()}", flush=True)


if __name__ == "__main__":
    main()
