"""What the sampling surface costs: speculation with penalties against plain decoding with
them, and logprobs' share of a decode, in one interleaved run.

    python bench/bench_processors.py [--bundle build/smollm2.dsmodel] [--json OUT]

On the peer prompts (samples/prompts/peer_prompts.jsonl: code, chat, edit), greedy, one
request at a time, every prompt in every mode, the modes taking turns: plain and default
speculation, each with no processors, with penalties (presence 0.5, frequency 0.3,
repetition 1.1, a logit_bias), and default with logprobs (5 top ones a token). Reports
tok/s per class and mode, default / plain with penalties, and logprobs' cost against the
same mode without them. Every prompt's tokens with penalties must match between plain and
default (`same`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "samples" / "prompts" / "peer_prompts.jsonl"
MODES = {  # name: (speculative, penalties, logprobs)
    "plain": (False, False, None), "default": (True, False, None),
    "plain+penalties": (False, True, None), "default+penalties": (True, True, None),
    "default+logprobs": (True, False, 5),
}


def main() -> None:
    from bench_peers import cpu_line
    from revision import revision

    from dspark.runtime.engine.loader import load_engine
    from dspark.runtime.sequence.processors import Penalties
    from dspark.runtime.sequence.request import GenerationRequest

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, default=ROOT / "build" / "smollm2.dsmodel")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    measured = revision()
    engine, tok = load_engine(args.bundle, watch=False)
    prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    penalties = Penalties(presence=0.5, frequency=0.3, repetition=1.1,
                          logit_bias=((tok.encode("Sure")[0], -2.0),))
    runs: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[str, str], list[int]] = {}
    for rep in range(args.repeats):
        for prompt in prompts:
            ids = tuple(tok.encode_chat([{"role": "user", "content": prompt["chat"]}]))
            names = list(MODES)[rep % len(MODES):] + list(MODES)[:rep % len(MODES)]
            for name in names:
                spec, pen, logprobs = MODES[name]
                t0 = time.perf_counter()
                [seq] = engine.generate([GenerationRequest(
                    ids, args.max_tokens, speculative=spec, cache_prompt=False,
                    penalties=penalties if pen else Penalties(), logprobs=logprobs)])
                tps = len(seq.generated) / (time.perf_counter() - t0)
                runs.setdefault((prompt["class"], name), []).append(tps)
                outputs[(prompt["name"], name)] = seq.generated
    same = all(outputs[(p["name"], "plain+penalties")] == outputs[(p["name"],
               "default+penalties")] for p in prompts)
    classes = sorted({p["class"] for p in prompts})
    tps = {(c, m): statistics.median(runs[(c, m)]) for c in classes for m in MODES}
    report = {"cpu": cpu_line(), "revision": measured, "tps": {f"{c}/{m}": v
                                                               for (c, m), v in tps.items()},
              "same": same, "setup": f"{args.bundle.name}, {args.max_tokens} tokens, greedy, "
                                     f"{args.repeats} repeats"}
    print("\n".join([report["cpu"], report["setup"], "", *table(report)]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


def table(report: dict) -> list[str]:
    tps = report["tps"]
    classes = sorted({k.split("/")[0] for k in tps})
    lines = ["| class | " + " | ".join(f"{m} tok/s" for m in MODES)
             + " | default / plain, penalties | logprobs' cost |", "|---" * (len(MODES) + 3)
             + "|"]
    for c in classes:
        cost = 1 - tps[f"{c}/default+logprobs"] / tps[f"{c}/default"]
        lines.append(f"| {c} | " + " | ".join(f"{tps[f'{c}/{m}']:.1f}" for m in MODES)
                     + f" | {tps[f'{c}/default+penalties'] / tps[f'{c}/plain+penalties']:.2f}x"
                     f" | {cost:.1%} |")
    lines.append(f"\nSame tokens with penalties, plain and default: "
                 f"{'yes' if report['same'] else 'NO'}")
    return lines


if __name__ == "__main__":
    main()
