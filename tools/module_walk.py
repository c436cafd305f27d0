"""How often each runtime module is entered per engine step, following one chat request.

    python tools/module_walk.py [--model build/smollm2.dsmodel] [--steps 10]

A module is "entered" when a function in it is called from another module (a call within
the module does not count, nor does resuming a generator or comprehension it defines). The
request runs a few steps first (prefill, warm costs), then the counts of the next --steps
steps are averaged: a view of the seams a round crosses.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

PROMPT = [{"role": "user", "content": "Write a haiku about the sea."}]


def walk(model: Path, steps: int) -> dict[str, float]:
    from dspark.runtime.engine.loader import load_engine
    from dspark.runtime.sequence.request import GenerationRequest

    engine, tokenizer = load_engine(model, warmup=False)
    ids = (tokenizer.encode_chat(PROMPT) if tokenizer.chat_template
           else tokenizer.encode(PROMPT[0]["content"]))
    engine.submit(GenerationRequest(tuple(ids), 16 + 8 * steps))
    for _ in range(3):
        engine.step()
    counts: Counter[str] = Counter()

    def entered(frame, event, _arg):
        name = frame.f_code.co_filename
        if event == "call" and "/runtime/" in name and frame.f_code.co_name[0] != "<" and (
                frame.f_back is None or frame.f_back.f_code.co_filename != name):
            counts[name.split("/runtime/", 1)[1]] += 1

    done = 0
    while engine.busy and done < steps:
        sys.setprofile(entered)
        engine.step()
        sys.setprofile(None)
        done += 1
    return {module: n / max(1, done) for module, n in counts.most_common()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("build/smollm2.dsmodel"))
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    for module, per_step in walk(args.model, args.steps).items():
        print(f"{per_step:6.1f} per step  runtime/{module}")


if __name__ == "__main__":
    main()
