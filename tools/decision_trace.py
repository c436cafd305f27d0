"""Every round's decision for a fixed mix of requests, on a virtual clock, so that two
revisions can be compared decision for decision.

    python tools/decision_trace.py [--model build/smollm2.dsmodel] [--policy goodput]
                                   [--out build/reports/decisions.json]

Each forward "takes" a + b * tokens virtual seconds (the main's and the draft's own a and b)
and every other clock read returns the virtual time, and the host's load reads as none: the
measured costs, and so every decision, are the same in every run of one revision. Six
concurrent requests (the hybrid, lookup and draft methods, a sampled one, a capped window,
a JSON grammar) run three times in rotation, then one alone. Per step it records each
slot's method, windows, source, verify length and verified drafts, and prints the number of
steps and a hash of the trace and of the outputs: a refactor of the round's decision that
changes nothing prints the same two hashes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

PROMPTS = ["Write a haiku about the sea.", "List three colors and say why you like them.",
           "Repeat after me: the cat sat on the mat, the cat sat on the mat.",
           "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\n# now explain it",
           "Summarize: The quick brown fox jumps over the lazy dog. The quick brown fox."]
COSTS = {"main": (0.020, 0.0012), "draft": (0.004, 0.0004)}  # seconds: a, b per token
PER_SEQUENCE = 0.0002


class VirtualClock:
    def __init__(self):
        self.now, self.pending = 1000.0, 0.0

    def read(self) -> float:
        return self.now

    def forward(self, *args, _build, **kwargs):
        """The batch of a forward is built between its timer's reads: time passes there."""
        self.now, self.pending = self.now + self.pending, 0.0
        return _build(*args, **kwargs)


def install(clock: VirtualClock, trace: list) -> None:
    """Clock, host load and forward costs made virtual; each verify's plan recorded."""
    time.perf_counter = time.monotonic = time.time = clock.read
    from dspark.runtime import host_load
    from dspark.runtime.engine.engine import Engine
    from dspark.runtime.model import runner

    host_load.HostLoad.sample = lambda self: 0.0
    forward, build, verify = runner.ModelRunner.forward, runner.FlatBatch.build, Engine._verify

    def priced(self, chunks, rows, cost_role=None, record=True):
        a, b = COSTS["main" if self.role == "main" else "draft"]
        clock.pending = a + b * sum(len(c[2]) for c in chunks) + PER_SEQUENCE * len(chunks)
        return forward(self, chunks, rows, cost_role, record)

    def recorded(self, plan):
        trace.append([(s.seq.id, s.method, s.window, s.lookup, s.source, s.verify,
                       list(s.pending.tokens[:s.verify])) for s in plan])
        return verify(self, plan)

    runner.ModelRunner.forward = priced
    runner.FlatBatch.build = staticmethod(lambda *a, **k: clock.forward(*a, _build=build, **k))
    Engine._verify = recorded


def requests(tokenizer):
    from dspark.runtime.grammar.formats import response_format_grammar
    from dspark.runtime.sequence.request import GenerationRequest
    from dspark.runtime.sequence.sampling import SamplingParams

    variants = [{}, {"method": "lookup"}, {"method": "draft"},
                {"sampling": SamplingParams(temperature=0.8, seed=7)}, {"max_window": 2},
                {"grammar": response_format_grammar({"type": "json_object"})}]

    def ids(text):
        chat = [{"role": "user", "content": text}]
        return tuple(tokenizer.encode_chat(chat) if tokenizer.chat_template
                     else tokenizer.encode(text))

    for phase in range(3):
        yield [GenerationRequest(ids(p), 40 + 8 * i, **variants[(i + phase) % len(variants)])
               for i, p in enumerate(PROMPTS + PROMPTS[:1])]
    yield [GenerationRequest(ids(PROMPTS[2]), 64)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path("build/smollm2.dsmodel"))
    ap.add_argument("--policy", help="a window policy (default: the bundle's)")
    ap.add_argument("--out", type=Path, help="write the trace and outputs (JSON)")
    args = ap.parse_args()
    clock, trace = VirtualClock(), []
    install(clock, trace)
    from dspark.runtime.engine.loader import load_engine

    engine, tokenizer = load_engine(args.model, warmup=True, watch=False)
    if args.policy:
        engine.planner.set_policy(args.policy)
    outputs = []
    for batch in requests(tokenizer):
        seqs = [engine.submit(r) for r in batch]
        while engine.busy:
            engine.step()
        outputs += [list(s.generated) for s in seqs]
    blob = json.dumps({"trace": trace, "outputs": outputs})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(blob)
    digest = lambda text: hashlib.sha256(text.encode()).hexdigest()[:16]
    print(f"{len(trace)} steps  decisions {digest(blob)}  outputs {digest(json.dumps(outputs))}")


if __name__ == "__main__":
    main()
