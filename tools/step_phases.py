"""Where an engine step's time goes beside its forward, per generated token, plain decoding
against the default (speculative) mode, in one process.

    python tools/step_phases.py [--bundle build/smollm2-q4.dsmodel] [--class chat]
                                  [--repeats 3] [--max-tokens 128]

Wraps the engine's stages (the round's decision: its windows, drafts and verify lengths;
the verify forward; acceptance and commit with the drafting's settle and the window
policy's observe; between-step maintenance) in timers, runs the class's peer prompts
(samples/prompts/peer_prompts.jsonl) plain then default, alternating, and prints each
stage's median microseconds per token in each mode and the difference. Each timer adds
~0.3 us a call. What an int4 main pays for speculating when its lookups find nothing is
here; `round_costs.py` times whole rounds by kind.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

from dspark.runtime.cli.bench import _one
from dspark.runtime.drafting import hybrid
from dspark.runtime.engine import decide, planner
from dspark.runtime.engine import engine as engine_module
from dspark.runtime.engine.loader import load_engine
from dspark.runtime.model.device import cpu_line
from dspark.runtime.sequence.prompt import entry_ids, load_prompts

PROMPTS = Path(__file__).resolve().parents[1] / "samples" / "prompts" / "peer_prompts.jsonl"
STAGES = [(engine_module.Engine, "step", "step"),
          (engine_module.Engine, "maintain", "maintain"),
          (engine_module, "decide", "decide"),
          (decide, "_windows", "decide: windows"),
          (decide, "drafts", "decide: drafts"),
          (decide, "_verify", "decide: verify"),
          (engine_module.Engine, "_verify", "verify forward"),
          (engine_module.Engine, "_advance", "advance"),
          (hybrid.HybridDrafter, "settle", "advance: settle"),
          (planner.WindowPlanner, "observe", "advance: observe")]


def engine_and_prompts(bundle: Path, cls: str):
    """The bundle's engine and the token ids of the peer prompts of class `cls`."""
    engine, tokenizer = load_engine(bundle, None, watch=False)[:2]
    prompts = [p for p in load_prompts(PROMPTS) if p["class"] == cls]
    if not prompts:
        raise SystemExit(f"error: --class {cls!r}: no such class in {PROMPTS}")
    return engine, [entry_ids(tokenizer, p) for p in prompts]


def instrument(spent: dict[str, float]) -> None:
    for cls, name, label in STAGES:
        inner = getattr(cls, name)

        def timed(*args, _inner=inner, _label=label, **kwargs):
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[_label] += time.perf_counter() - t0

        setattr(cls, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=Path("build/smollm2-q4.dsmodel"))
    ap.add_argument("--class", dest="cls", default="chat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    spent: dict[str, float] = defaultdict(float)
    instrument(spent)
    engine, ids = engine_and_prompts(args.bundle, args.cls)
    _one(engine, ids[0], 8, True)  # first runs: allocations
    _one(engine, ids[0], 8, False)
    per_token: dict[tuple[bool, str], list[float]] = defaultdict(list)
    for r in range(args.repeats):
        for spec in ((False, True) if r % 2 == 0 else (True, False)):
            spent.clear()
            tokens = sum(len(_one(engine, p, args.max_tokens, spec)["tokens"]) for p in ids)
            for _, _, label in STAGES:
                per_token[(spec, label)].append(1e6 * spent[label] / tokens)
    print(cpu_line())
    print(f"{args.bundle}, {len(ids)} {args.cls} prompts x {args.repeats}, "
          f"{args.max_tokens} new tokens; median us per generated token")
    print(f"{'stage':18s} {'plain':>9s} {'default':>9s} {'default-plain':>14s}")
    for _, _, label in STAGES:
        a, b = (statistics.median(per_token[(spec, label)]) for spec in (False, True))
        print(f"{label:18s} {a:9.1f} {b:9.1f} {b - a:14.1f}")


if __name__ == "__main__":
    main()
