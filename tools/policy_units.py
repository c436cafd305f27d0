"""A drafting policy's speed-up with the VM's timing noise taken out: every speculative round
priced at one verify curve, in decodes.

    python tools/policy_units.py [--model build/smollm2-q4.dsmodel] [--repeats 3]
                                   [--curve 1,1.37,1.55,...]

Runs the 12 peer prompts (samples/prompts/peer_prompts.jsonl) with default speculation,
greedy, 128 new tokens, in one process, and prices each round by the curve: a forward of k
tokens costs curve[k-1] decodes (past the curve's end, its last step again per token). Per
class it prints the tokens the rounds emitted per decode of that price: the speed-up of the
forwards over plain decoding, one decode a token. The drafting path's own work between the
forwards is left out (`step_phases.py` times it).

Without --curve the curve is this run's own: each verify size's median forward over the
median one-token forward of the same run (sizes seen fewer than MIN_SEEN times are
interpolated between their neighbours). It is printed, so that a second run (another
revision, another setting) can be priced with the same one.

Why: old-against-new runs of `dsrun bench` on this VM differ by 2-4% between runs of the
same code, in one process too, which is larger than most policy changes. This count differs
by ~0.5% (chat) to ~1.5% (edits) between runs of the same code: what is left is the policy's
own choices, which follow measured costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

PROMPTS = Path(__file__).resolve().parents[1] / "samples" / "prompts" / "peer_prompts.jsonl"
MIN_SEEN = 3


def price(curve: list[float], tokens: int) -> float:
    """Decodes a forward of `tokens` costs by the curve."""
    if tokens <= len(curve):
        return curve[tokens - 1]
    step = curve[-1] - curve[-2] if len(curve) > 1 else curve[-1]
    return curve[-1] + (tokens - len(curve)) * step


def own_curve(forwards: dict[int, list[float]]) -> list[float]:
    """Each size's median over the one-token median; sizes seen under MIN_SEEN times are
    interpolated (linearly) between the nearest well-seen ones, and the end extended."""
    decode = statistics.median(forwards[1])
    seen = {k: statistics.median(v) / decode for k, v in forwards.items() if len(v) >= MIN_SEEN}
    if len(seen) < 2:  # no verify size seen often: every size as it came
        seen = {k: statistics.median(v) / decode for k, v in forwards.items()}
    seen[1] = 1.0
    keys = sorted(seen)
    top = max(forwards)
    curve = []
    for k in range(1, top + 1):
        if k in seen:
            curve.append(seen[k])
            continue
        lo = max(x for x in keys if x < k)
        hi = next((x for x in keys if x > k), None)
        if hi is None:  # past the last well-seen size: its step from the one before
            prev = max(x for x in keys if x < lo)
            step = (seen[lo] - seen[prev]) / (lo - prev)
            curve.append(seen[lo] + (k - lo) * step)
        else:
            curve.append(seen[lo] + (k - lo) / (hi - lo) * (seen[hi] - seen[lo]))
    return curve


def run(model: Path, repeats: int) -> tuple[dict, dict[int, list[float]]]:
    """Per class the (tokens, forward size) of every speculative round, and every forward's
    milliseconds by its size."""
    from dspark.runtime.engine.loader import load_engine
    from dspark.runtime.sequence.request import GenerationRequest
    from dspark.runtime.sequence.sampling import SamplingParams

    engine, tokenizer = load_engine(model)[:2]
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    rounds: dict[str, list[tuple[int, int]]] = defaultdict(list)
    forwards: dict[int, list[float]] = defaultdict(list)
    for _ in range(repeats):
        for row in rows:
            ids = tuple(tokenizer.encode_chat([{"role": "user", "content": row["chat"]}]))
            engine.submit(GenerationRequest(ids, 128, SamplingParams(0.0), speculative=True))
            while engine.busy:
                report = engine.step()
                if report.verify_ms is None or not report.rounds:
                    continue  # a prompt's forward: the same in both modes
                r = report.rounds[0]
                rounds[row["class"]].append((1 + r.accepted, 1 + r.drafted))
                forwards[1 + r.drafted].append(report.verify_ms)
    return rounds, forwards


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("build/smollm2-q4.dsmodel"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--curve", help="comma-separated decodes per forward of 1, 2, ... tokens")
    args = p.parse_args()
    if not args.model.exists():
        raise SystemExit(f"error: --model {args.model}: no such bundle")
    curve = None
    if args.curve:
        try:
            curve = [float(x) for x in args.curve.split(",")]
        except ValueError:
            raise SystemExit(
                f"error: --curve {args.curve!r}: not comma-separated numbers") from None
        if curve[0] != 1.0 or min(curve) <= 0:
            raise SystemExit(f"error: --curve {args.curve!r}: must start at 1 (a decode), "
                             "every price above 0")
    from dspark.runtime.model.device import cpu_line

    rounds, forwards = run(args.model, args.repeats)
    curve = curve or own_curve(forwards)
    print(cpu_line())
    print(f"{args.model}, {args.repeats} repeats; curve "
          + ",".join(f"{c:.2f}" for c in curve))
    for cls, xs in sorted(rounds.items()):
        tokens = sum(t for t, _ in xs)
        units = sum(price(curve, k) for _, k in xs)
        verifies = sum(k > 1 for _, k in xs)
        print(f"{cls:5s} {tokens / units:.3f}x plain  ({len(xs)} rounds, {verifies} verifies)")


if __name__ == "__main__":
    main()
