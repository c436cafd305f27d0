"""Constrained generation (JSON schema) on SmolLM2: plain vs speculation, one process.

    python bench/bench_structured.py [--bundle build/smollm2.dsmodel] [--repeats 2]
                                       [--methods hybrid draft lookup] [--max-tokens 160]

Every case of samples/schemas/structured_cases.jsonl (a prompt and a JSON schema) runs
alone (one request at a time, as in bench/bench_peers.py) with speculation off, then
with each drafting method, the modes taking turns per case and repeat so the VM's drift
hits them alike. Prints tok/s per mode and its ratio to constrained plain, whether each
mode's tokens equal plain's (greedy: they must), how many outputs parse and validate
against their schema, the forced (jump-forward) share of drafts, and the grammar's mask
cost per token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "samples" / "schemas" / "structured_cases.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=ROOT / "build" / "smollm2.dsmodel")
    ap.add_argument("--cases", type=Path, default=CASES)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--methods", nargs="+", default=["hybrid", "draft", "lookup"])
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()

    import jsonschema

    from dspark.runtime.engine.loader import load_engine
    from dspark.runtime.grammar.formats import schema_grammar
    from dspark.runtime.sequence.prompt import prompt_ids
    from dspark.runtime.sequence.request import GenerationRequest

    engine, tokenizer = load_engine(args.bundle)
    cases = [json.loads(line) for line in args.cases.read_text().splitlines() if line.strip()]
    modes = ["plain", *args.methods]
    tokens = {m: 0 for m in modes}
    seconds = {m: 0.0 for m in modes}
    same = {m: 0 for m in modes}
    valid = {m: 0 for m in modes}
    forced = drafted = masks = 0
    for repeat in range(args.repeats):
        for n, case in enumerate(cases):
            ids = prompt_ids(tokenizer, None, case["prompt"], None)
            grammar = schema_grammar(case["schema"], "schema")
            order = modes[(n + repeat) % len(modes):] + modes[:(n + repeat) % len(modes)]
            outputs = {}
            for mode in order:
                request = GenerationRequest(tuple(ids), args.max_tokens, grammar=grammar,
                                            speculative=mode != "plain",
                                            method=None if mode == "plain" else mode)
                t0 = time.perf_counter()
                [seq] = engine.generate([request])
                seconds[mode] += time.perf_counter() - t0
                tokens[mode] += len(seq.generated)
                outputs[mode] = seq.generated
                masks += seq.constraint.masks
                try:
                    jsonschema.validate(json.loads(tokenizer.decode(seq.generated)),
                                        case["schema"])
                    valid[mode] += 1
                except (ValueError, jsonschema.ValidationError):
                    print(f"[structured] case {n} {mode}: invalid "
                          f"({seq.finish_reason}): {tokenizer.decode(seq.generated)!r}",
                          file=sys.stderr)
                if mode != "plain":
                    src = seq.stats.sources
                    forced += src["grammar"].drafted if "grammar" in src else 0
                    drafted += seq.stats.draft_tokens
            for mode in modes:
                same[mode] += outputs[mode] == outputs["plain"]
    runs = len(cases) * args.repeats
    plain_rate = tokens["plain"] / seconds["plain"]
    print(f"{len(cases)} cases x {args.repeats} repeats, greedy, max_tokens {args.max_tokens}")
    print(f"{'mode':8} {'tok/s':>7} {'vs plain':>9} {'same tokens':>12} {'valid JSON':>11}")
    for mode in modes:
        rate = tokens[mode] / seconds[mode]
        print(f"{mode:8} {rate:7.1f} {rate / plain_rate:8.2f}x {same[mode]:>6}/{runs:<5} "
              f"{valid[mode]:>5}/{runs}")
    print(f"forced (grammar) drafts: {forced} of {drafted} drafted; grammar masks computed: "
          f"{masks} for {sum(tokens.values())} tokens")
    grammar = schema_grammar(cases[0]["schema"], "schema")
    constraint = engine.grammars.constraint(grammar)
    t0 = time.perf_counter()
    for _ in range(200):
        constraint.allowed()
    print(f"mask cost: {(time.perf_counter() - t0) / 200 * 1e6:.0f} us per position "
          f"(vocab {constraint.vocab_size})")


if __name__ == "__main__":
    main()
