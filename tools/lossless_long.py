"""Greedy output of a bundle against the original model's own greedy loop, at long prompts.

    python tools/lossless_long.py --bundle build/gemma3.dsmodel --main build/gemma3/main.onnx \
        [--lengths 50,300,511,513,876,1200,1500] [--max-tokens 32] [--json]

Prompts are the first N tokens of Python standard-library source (the same text on every
machine, and a natural continuation for a base model). The reference is the exported model
run alone in onnxruntime with its own KV-cache I/O (compiler/reference.py). The bundle runs
every prompt under several settings: plain (no speculation), the default, a fixed window of
4, the draft model only and the lookup only. A difference is forgiven only at a fork where
the reference's top-1/top-2 margin is below --margin (a near-tie that batched sums may
break the other way); anything else is reported as a mismatch and the exit code is 1.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import sys
from pathlib import Path

import numpy as np

# (name, speculative, window policy, window, drafting method); None: the bundle's config
SETTINGS = [("plain", False, None, None, None), ("default", True, None, None, None),
            ("window 4", True, "fixed", 4, None), ("draft only", True, None, None, "draft"),
            ("lookup only", True, None, None, "lookup")]


def corpus_ids(tokenizer, need: int) -> list[int]:
    import asyncio
    import difflib
    import textwrap

    text = "".join(inspect.getsource(m) for m in (textwrap, difflib, asyncio.queues))
    ids = tokenizer.encode(text)
    if len(ids) < need:
        raise SystemExit(f"the corpus has {len(ids)} tokens, fewer than {need}")
    return ids


def fork(got: list[int], ref: list[int], prompt: list[int], original, margin: float) -> str:
    """'same', 'near-tie fork at i (margin m)', or 'MISMATCH at i (margin m)'."""
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            logits, _ = original.forward(prompt + ref[:i], original.empty_past())
            top2 = np.sort(logits[-1].astype(np.float64))[-2:]
            gap = float(top2[1] - top2[0])
            kind = "near-tie fork" if gap < margin else "MISMATCH"
            return f"{kind} at token {i} (margin {gap:.2e})"
    return "same" if len(got) == len(ref) else f"MISMATCH: {len(got)} tokens, not {len(ref)}"


def run(args) -> list[dict]:
    from dspark.compiler.reference import OriginalModel
    from dspark.runtime.bundle.bundle import open_bundle
    from dspark.runtime.bundle.tokenizer import load_tokenizer
    from dspark.runtime.engine.engine import Engine
    from dspark.runtime.sequence.request import GenerationRequest

    bundle = open_bundle(args.bundle)
    original = OriginalModel(args.main)
    text = corpus_ids(load_tokenizer(bundle.tokenizer_dir), max(args.lengths))
    refs = {n: original.greedy(text[:n], args.max_tokens) for n in args.lengths}
    rows = []
    for name, spec, policy, window, method in SETTINGS:
        if method == "draft" and "draft" not in bundle.models:
            continue
        engine = Engine(bundle, policy, window)  # one per setting: each holds the models
        for n in args.lengths:
            prompt = text[:n]
            [seq] = engine.generate([GenerationRequest(tuple(prompt), args.max_tokens,
                                                       speculative=spec, method=method)])
            verdict = fork(seq.generated, refs[n], prompt, original, args.margin)
            rows.append({"prompt": n, "setting": name, "verdict": verdict,
                         "accepted": seq.stats.accepted_tokens,
                         "drafted": seq.stats.draft_tokens})
            print(f"prompt {n:5d}  {name:<12} {verdict}  (accepted {seq.stats.accepted_tokens} "
                  f"of {seq.stats.draft_tokens} drafts)", file=sys.stderr, flush=True)
        del engine
        gc.collect()  # its sessions and arena go before the next setting's
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--main", type=Path, required=True, help="the main ONNX model")
    p.add_argument("--lengths", default="50,300,511,513,876,1200,1500",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--margin", type=float, default=1e-3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from dspark.runtime.model.sessions import init_threads

    init_threads()
    rows = run(args)
    if args.json:
        print(json.dumps(rows, indent=2))
    bad = [r for r in rows if r["verdict"].startswith("MISMATCH")]
    print(f"{len(rows) - len(bad)} of {len(rows)} runs equal the original's greedy tokens "
          f"(near-tie forks below {args.margin} forgiven)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
