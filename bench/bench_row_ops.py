"""Our norms and SiLU (runtime/model/row_ops.py) against onnxruntime's, one bundle loaded both
ways in one process, requests interleaved.

    python bench/bench_row_ops.py [--bundle build/smollm2-q4.dsmodel] [--repeats 2]
                                    [--max-tokens 128] [--background-load]

The bundle is loaded twice: with DSPARK_CPU_ROWS=0 (onnxruntime's SimplifiedLayerNormalization
and QuickGelu, which it fuses at load) and as dsrun loads it. Each of the 12 peer prompts
(samples/prompts/peer_prompts.jsonl) runs plain and default on both, in a rotated order, on
the process's one pool. Printed per class: median tok/s of each, ours over onnxruntime's,
and each one's default over its own plain. `--background-load`: another process spins on one
core from after the warm-up, so the forwards leave the pool (load_gate.py): what the row ops
are for. The report starts with the CPU's model and flags.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from dspark.runtime.cli.bench import _one, busy_core
from dspark.runtime.engine.loader import load_engine
from dspark.runtime.model.device import cpu_line
from dspark.runtime.sequence.prompt import entry_ids, load_prompts

PROMPTS = Path(__file__).resolve().parents[1] / "samples" / "prompts" / "peer_prompts.jsonl"


def _load(bundle: Path, rows: bool):
    os.environ["DSPARK_CPU_ROWS"] = "1" if rows else "0"
    try:
        return load_engine(bundle, None, watch=False)
    finally:
        os.environ.pop("DSPARK_CPU_ROWS")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=Path("build/smollm2-q4.dsmodel"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--background-load", action="store_true")
    args = ap.parse_args()
    engines = {"onnxruntime": _load(args.bundle, False), "ours": _load(args.bundle, True)}
    prompts = load_prompts(PROMPTS)
    tokenizer = engines["ours"][1]
    ids = [(p["class"], entry_ids(tokenizer, p)) for p in prompts]
    variants = [(name, spec) for name in engines for spec in (False, True)]
    for name, spec in variants:  # first runs: allocations
        _one(engines[name][0], ids[0][1], 8, spec)
    tps: dict[tuple[str, str, bool], list[float]] = {}
    same = True
    with busy_core(args.background_load):
        for r in range(args.repeats):
            for i, (cls, prompt) in enumerate(ids):
                k = (r + i) % len(variants)
                out = {}
                for name, spec in variants[k:] + variants[:k]:
                    run = _one(engines[name][0], prompt, args.max_tokens, spec)
                    tps.setdefault((cls, name, spec), []).append(run["tps"])
                    out[(name, spec)] = run["tokens"]
                same &= all(out[(n, True)] == out[(n, False)] for n in engines)
    print(cpu_line())
    print(f"{args.bundle}, {args.max_tokens} new tokens, {args.repeats} repeats, interleaved"
          + (", one core busy with another process" if args.background_load else ""))
    print("class  mode     onnxruntime tok/s  ours tok/s  ours/onnxruntime  default/plain "
          "(onnxruntime, ours)")
    for cls in sorted({c for c, _ in ids}):
        med = {(n, s): statistics.median(tps[(cls, n, s)]) for n, s in variants}
        for spec in (False, True):
            a, b = med[("onnxruntime", spec)], med[("ours", spec)]
            gain = (f"{a / med[('onnxruntime', False)]:.2f}x, "
                    f"{b / med[('ours', False)]:.2f}x") if spec else ""
            print(f"{cls:6} {'default' if spec else 'plain':8} {a:17.1f} {b:11.1f} "
                  f"{b / a:16.2f}x  {gain}")
    print(f"every default output the same as its plain: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
