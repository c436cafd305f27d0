"""Does segmenting cost? dsrun's plain decoding against a single onnxruntime session.

The reference is the original main.onnx in one session, KV cache through run() (what an
exporter's own greedy loop does), twice: with onnxruntime's default options in a process of
its own (its own thread pool: the plain baseline; a process with a global pool cannot hold
such a session), and on dsrun's shared pool in dsrun's process (a tuned baseline). All run
the same prompts greedily, one at a time, interleaved; the script prints prefill ms, decode
ms/token and tokens/s for each, and the ratios.

    python samples/bench_segmenting.py --bundle build/smollm2.dsmodel \
        --main build/smollm2/main.onnx [--tokens 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from pathlib import Path


def single_session(original, ids: list[int], n: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    logits, past = original.forward(ids, original.empty_past())
    t1 = time.perf_counter()
    token = int(logits[-1].argmax())
    for _ in range(n - 1):
        logits, past = original.forward([token], past)
        token = int(logits[-1].argmax())
    return t1 - t0, (time.perf_counter() - t1) / (n - 1)


def segmented(engine, ids: list[int], n: int) -> tuple[float, float]:
    from dspark.runtime.sequence.request import GenerationRequest

    t0 = time.perf_counter()
    [seq] = engine.generate([GenerationRequest(tuple(ids), n, speculative=False)])
    total = time.perf_counter() - t0
    return seq.ttft_s, (total - seq.ttft_s) / (n - 1)


def plain_worker(main: str, conn) -> None:
    """A process with onnxruntime's defaults: one session, its own pool."""
    import onnxruntime as ort

    from dspark.compiler.reference import OriginalModel

    session = ort.InferenceSession(main, providers=["CPUExecutionProvider"])
    original = OriginalModel(Path(main), session)
    while (job := conn.recv()) is not None:
        conn.send(single_session(original, *job))


class Plain:
    def __init__(self, main: Path):
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=plain_worker, args=(str(main), child),
                                                    daemon=True)
        self.proc.start()

    def __call__(self, _, ids: list[int], n: int) -> tuple[float, float]:
        self.conn.send((ids, n))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join()


def main() -> None:
    from dspark.compiler.reference import OriginalModel
    from dspark.runtime.cli.bench import _ids, load_prompts
    from dspark.runtime.engine.loader import load_engine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, default=Path("build/smollm2.dsmodel"))
    p.add_argument("--main", type=Path, default=Path("build/smollm2/main.onnx"))
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--context", type=int, default=0,
                   help="pad each prompt to this many tokens (a longer cached context)")
    args = p.parse_args()
    plain = Plain(args.main)
    engine, tokenizer = load_engine(args.bundle)
    engine.eos_ids = frozenset()  # like the single-session loop: always generate --tokens
    tuned = OriginalModel(args.main)
    prompts = [_ids(tokenizer, x) for x in load_prompts(None)][:4]
    if args.context:
        filler = [t for p in prompts for t in p] * (1 + args.context // 30)
        prompts = [(filler[: max(0, args.context - len(p))] + p) for p in prompts]
    contenders = (("plain", plain, None), ("tuned", single_session, tuned),
                  ("dsrun", segmented, engine))
    for _, fn, model in contenders:
        fn(model, prompts[0], 8)
    runs = {name: [] for name, _, _ in contenders}
    for r in range(args.repeats):
        for ids in prompts:
            for name, fn, model in contenders if r % 2 == 0 else contenders[::-1]:
                runs[name].append(fn(model, ids, args.tokens))
    plain.close()
    print(f"{len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens) x "
          f"{args.repeats} repeats, {args.tokens} new tokens, greedy, interleaved (medians)")
    med = {}
    for name, rs in runs.items():
        prefill = statistics.median(r[0] for r in rs) * 1000
        decode = statistics.median(r[1] for r in rs) * 1000
        med[name] = decode
        print(f"  {name:<6} prefill {prefill:7.1f} ms   decode {decode:6.2f} ms/token "
              f"({1000 / decode:5.1f} tok/s)")
    print(f"dsrun plain decode vs single session (default options): "
          f"{med['plain'] / med['dsrun']:.3f}x; vs single session on the shared pool: "
          f"{med['tuned'] / med['dsrun']:.3f}x")


if __name__ == "__main__":
    main()
