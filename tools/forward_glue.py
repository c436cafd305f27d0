"""What a main forward costs beside onnxruntime's own run, in the running engine.

    python tools/forward_glue.py [--bundle build/smollm2-q4.dsmodel] [--class chat]
                                   [--repeats 3]
    PYTHONPATH=build/revisions/5719e2b-path python tools/forward_glue.py  # an older one

Plain decoding of the class's peer prompts (samples/prompts/peer_prompts.jsonl), 128 new
tokens each. Every ModelRunner.forward is timed whole and around its session's
run_with_iobinding; the difference is the Python around it: the batch's arrays, the
input bindings, the block tables, the logits' copy and split, the cost table's update.
It prints both per forward (mean). After a forward has streamed the weights through the
caches each numpy call there costs ~10 us, so the glue is larger here than in a loop
that repeats one call. An older revision, first on PYTHONPATH as above
(bench_revisions.py checks one out), is measured the same way.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from step_phases import engine_and_prompts

from dspark.runtime.cli.bench import _one
from dspark.runtime.model.device import cpu_line
from dspark.runtime.model.runner import ModelRunner


class TimedSession:
    """A session whose run_with_iobinding adds its seconds to `spent`."""

    def __init__(self, session, spent: list[float]):
        self.session, self.spent = session, spent

    def run_with_iobinding(self, binding):
        t0 = time.perf_counter()
        try:
            return self.session.run_with_iobinding(binding)
        finally:
            self.spent[0] += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self.session, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=Path("build/smollm2-q4.dsmodel"))
    ap.add_argument("--class", dest="cls", default="chat")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    engine, ids = engine_and_prompts(args.bundle, args.cls)
    _one(engine, ids[0], 8, False)  # first runs: allocations
    ort, whole, forwards = [0.0], [0.0], [0]
    model = engine.main.model
    model.session = TimedSession(model.session, ort)
    inner = ModelRunner.forward

    def timed(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return inner(self, *a, **kw)
        finally:
            if self is engine.main:
                whole[0] += time.perf_counter() - t0
                forwards[0] += 1

    ModelRunner.forward = timed
    for _ in range(args.repeats):
        for p in ids:
            _one(engine, p, 128, False)
    n = forwards[0]
    print(cpu_line())
    print(f"{args.bundle}, {len(ids)} {args.cls} prompts x {args.repeats}, plain decoding, "
          f"{n} main forwards")
    print(f"per forward: {1e6 * whole[0] / n:.1f} us, of which onnxruntime's run "
          f"{1e6 * ort[0] / n:.1f} us and the Python around it "
          f"{1e6 * (whole[0] - ort[0]) / n:.1f} us")


if __name__ == "__main__":
    main()
