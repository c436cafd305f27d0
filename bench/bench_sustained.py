"""Sustained serving: does a server keep its speed, speculative and plain, once a busy minute
is behind it? One client, back to back, for --seconds.

    python bench/bench_sustained.py [--bundle build/smollm2-q4.dsmodel] [--seconds 120]
                                      [--window 20] [--base REV]

Starts `dsrun serve` on the bundle and sends the 12 peer prompts (greedy, --max-tokens each)
through the official openai client, one request at a time, speculation on and off in turn,
so both modes share every stretch of the run. Printed per window of --window seconds: each
mode's tok/s (completion tokens over the requests' wall time) and default over plain, then
the last window over the first. The metrics the server keeps (runtime/server/metrics.py)
cover the last minute, so what they cost a step shows from the second minute on.
`--base REV` runs the same afterwards with that revision's server (bench_revisions.py's
checkout), for its own per-window figures. The report starts with the CPU's model and flags.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from openai import OpenAI

from dspark.runtime.model.device import cpu_line
from dspark.runtime.sequence.prompt import load_prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "samples"))  # its builders
from load_test import start_server  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[1] / "samples" / "prompts" / "peer_prompts.jsonl"


def run(url: str, model: str, seconds: float, max_tokens: int) -> list[tuple]:
    """(start offset, speculative, tokens, wall seconds) of each request."""
    client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300)
    prompts = load_prompts(PROMPTS)
    out, i, t_start = [], 0, time.perf_counter()
    while time.perf_counter() - t_start < seconds:
        p, spec = prompts[(i // 2) % len(prompts)], i % 2 == 0
        t0 = time.perf_counter()
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p["chat"]}],
            max_tokens=max_tokens, temperature=0, extra_body={"speculative_decoding": spec})
        out.append((t0 - t_start, spec, r.usage.completion_tokens, time.perf_counter() - t0))
        i += 1
    return out


def report(label: str, runs: list[tuple], window: float) -> None:
    print(label)
    print("window (s)   default tok/s  plain tok/s  default/plain")
    ratios = []
    w = 0
    while any(w * window <= r[0] < (w + 1) * window for r in runs):
        part = [r for r in runs if w * window <= r[0] < (w + 1) * window]
        rate = {}
        for spec in (True, False):
            mine = [r for r in part if r[1] == spec]
            rate[spec] = sum(r[2] for r in mine) / sum(r[3] for r in mine) if mine else None
        if rate[True] and rate[False]:
            ratios.append((rate[True], rate[False]))
            print(f"{w * window:4.0f}-{(w + 1) * window:<6.0f} {rate[True]:14.1f} "
                  f"{rate[False]:12.1f} {rate[True] / rate[False]:14.2f}")
        w += 1
    if len(ratios) > 1:
        (d0, p0), (d1, p1) = ratios[0], ratios[-1]
        print(f"last window over the first: default {d1 / d0:.2f}x, plain {p1 / p0:.2f}x")


def serve_and_run(bundle: Path, seconds: float, max_tokens: int,
                  pythonpath: str | None) -> list[tuple]:
    old = os.environ.get("PYTHONPATH")
    if pythonpath:
        os.environ["PYTHONPATH"] = pythonpath
    try:
        proc, url = start_server(bundle, 8)
    finally:
        if pythonpath:
            os.environ.pop("PYTHONPATH") if old is None else os.environ.update(PYTHONPATH=old)
    try:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        run(url, model, 8, max_tokens)  # warm-up: sessions' first runs
        return run(url, model, seconds, max_tokens)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=Path("build/smollm2-q4.dsmodel"))
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--window", type=float, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--base", help="also run this revision's server, afterwards")
    args = ap.parse_args()
    if not args.bundle.exists():
        sys.exit(f"error: {args.bundle}: no such bundle (make peers builds the sample's)")
    runs = {"this checkout": serve_and_run(args.bundle, args.seconds, args.max_tokens, None)}
    if args.base:
        from bench_revisions import checkout

        runs[f"revision {args.base}"] = serve_and_run(args.bundle, args.seconds,
                                                       args.max_tokens, str(checkout(args.base)))
    print(cpu_line())
    print(f"{args.bundle}, one client back to back, {args.max_tokens} new tokens, "
          f"speculation on and off in turn, {args.seconds:.0f} s each")
    for label, r in runs.items():
        report(label, r, args.window)


if __name__ == "__main__":
    main()
