"""What each kind of round costs in the running engine, against what the cost table says.

    python tools/round_costs.py [--model build/smollm2-genai-int4.dsmodel]
                                  [--prompts photosynthesis interview sleep travel]
                                  [--repeats 4]

Each peer prompt (samples/prompts/peer_prompts.jsonl, by name) runs plain and with default
speculation, interleaved, 128 new tokens. Every step is timed (`engine.step`) beside its
verify forward (`StepReport.verify_ms`) and filed by its kind: plain decoding, or the
speculative round's method and drafts verified. Per kind: steps, median step and verify ms,
and the verify against a plain decode's, beside the cost table's ratio for that size. A
table ratio far under the measured one means the hybrid prices those verifies too cheaply.
Per kind of speculative round also the drafts kept, and what its rounds gained against plain
decoding in decodes: the tokens they emitted (kept drafts and the main's own) less their
verifies' cost in decodes. A kind whose gain is below zero lost time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

PROMPTS = Path(__file__).resolve().parents[1] / "samples" / "prompts" / "peer_prompts.jsonl"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("build/smollm2-genai-int4.dsmodel"))
    p.add_argument("--prompts", nargs="+",
                   default=["photosynthesis", "interview", "sleep", "travel"])
    p.add_argument("--repeats", type=int, default=4)
    args = p.parse_args()
    from dspark.runtime.engine.loader import load_engine
    from dspark.runtime.sequence.request import GenerationRequest
    from dspark.runtime.sequence.sampling import SamplingParams

    engine, tokenizer = load_engine(args.model)
    chats = {r["name"]: r["chat"] for r in map(json.loads, PROMPTS.read_text().splitlines())}
    steps: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    kept: dict[tuple[str, int], int] = defaultdict(int)
    for name in args.prompts:
        ids = tuple(tokenizer.encode_chat([{"role": "user", "content": chats[name]}]))
        for _ in range(args.repeats):
            for spec in (False, True):
                engine.submit(GenerationRequest(ids, 128, SamplingParams(0.0), speculative=spec))
                while engine.busy:
                    t0 = time.perf_counter()
                    report = engine.step()
                    seconds = time.perf_counter() - t0
                    if report.rounds:
                        r = report.rounds[0]
                        steps[(f"spec {r.method}", r.drafted)].append((seconds, report.verify_ms))
                        kept[(f"spec {r.method}", r.drafted)] += r.accepted
                    elif not spec and report.verify_ms is not None:
                        steps[("plain", 0)].append((seconds, report.verify_ms))
    decode = statistics.median(v for _, v in steps[("plain", 0)])
    one = engine.costs.seconds("main", 1)
    print(f"{args.model}: verify ms against a plain decode's ({decode:.2f} ms), measured and "
          "by the cost table")
    for (kind, drafted), xs in sorted(steps.items()):
        verify = statistics.median(v for _, v in xs)
        table = engine.costs.seconds("main", drafted + 1) / one
        line = (f"{kind:14s} drafts {drafted}  steps {len(xs):5d}  step "
                f"{1000 * statistics.median(s for s, _ in xs):6.2f} ms  verify {verify:6.2f} ms"
                f"  x{verify / decode:.2f} (table x{table:.2f})")
        if drafted:
            gain = len(xs) + kept[(kind, drafted)] - sum(v for _, v in xs) / decode
            line += f"  kept {kept[(kind, drafted)]:4d}  gain {gain:+7.1f} decodes"
        print(line)


if __name__ == "__main__":
    main()
