"""How close one request's decoding comes to the memory ceiling: the machine's read bandwidth,
the weight bytes each system reads per generated token, and the decode rate it measures,
dsrun beside llama-server on the same weights, in one interleaved run.

    python bench/bench_roofline.py [--rounds 3] [--json build/reports/roofline.json]

A decode step of a 135M model streams every weight once, so no engine generates one token
faster than bandwidth / bytes (its ceiling); the ratio of two engines' ceilings on the same
weights bounds what one of them can gain over the other at one client without speculation.
- bandwidth: bench/read_bandwidth.c, built here with $CC; every core reads its share of a
  1 GiB buffer, best of 5 (and one core alone, for reference).
- bytes per token: dsrun's main reads its segments' initializers whole, all but the tables
  only a gather reads (`dsrun bench --profile`'s count); llama.cpp reads every tensor of
  the GGUF (SmolLM2 ties its head to token_embd, so the table is read whole as the head).
- decode: dsrun's main model at a cached context of 128 tokens (median of 20 forwards) plus
  its engine's own time per token (scheduling, sampling, emitting); llama-server's
  `predicted_per_token_ms` for 64 tokens after a ~100-token prompt, one slot, threads at the
  core count. Rounds interleave the systems; the report gives each one's median.
The report starts with the CPU's model and flags.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import peer_setup as setup
import servers
from bench_peers import cpu_line
from revision import revision

from dspark.runtime.env import read_env

ROOT = Path(__file__).resolve().parent.parent
DSRUN = {"dsrun-fp32": setup.BUNDLES["fp32"], "dsrun-q4": setup.BUNDLES["q4"]}
LLAMA = {"llama-f32": lambda: setup.GGUF["f32"], "llama-q4_1": setup.q41_gguf}
SAME_WEIGHTS = (("dsrun-fp32", "llama-f32"), ("dsrun-q4", "llama-q4_1"))
CONTEXT, NEW_TOKENS = 128, 64


def log(msg: str) -> None:
    print(f"[roofline] {msg}", file=sys.stderr, flush=True)


def read_bandwidth(threads: int) -> float:
    """GB/s that `threads` threads read from memory (best of 5 over 1 GiB)."""
    with tempfile.TemporaryDirectory(prefix="roofline-") as tmp:
        binary = Path(tmp) / "read_bandwidth"
        built = subprocess.run([read_env().cc, "-O3", "-march=native", "-pthread",
                                str(ROOT / "bench" / "read_bandwidth.c"), "-o", str(binary)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            sys.exit(f"bench_roofline: building read_bandwidth.c failed: {built.stderr[-2000:]}")
        done = subprocess.run([str(binary), "1024", str(threads), "5"], capture_output=True,
                              text=True, check=True)
        return float(done.stdout)


def gguf_bytes(path: Path) -> int:
    """Every tensor's bytes: what llama.cpp streams per token of a tied-head model."""
    from gguf import GGUFReader

    tensors = GGUFReader(str(path)).tensors
    if not any(t.name == "token_embd.weight" for t in tensors) or any(
            t.name == "output.weight" for t in tensors):
        sys.exit(f"bench_roofline: {path} is not a tied-head model; its bytes per token "
                 "would need the head counted apart from the embedding")
    return sum(int(t.n_bytes) for t in tensors)


class Dsrun:
    def __init__(self, name: str, bundle: Path):
        from dspark.runtime.engine.loader import load_engine

        self.name = name
        self.engine, _ = load_engine(bundle)
        self.bytes = 0

    def ms_per_token(self) -> float:
        from dspark.runtime.cli.profile import profile_engine

        p = profile_engine(self.engine, context=CONTEXT, repeats=20, ops=False)
        self.bytes = p["models"]["main"]["weight_bytes"]
        return p["models"]["main"]["steps"]["decode"]["total_ms"] + \
            p["engine"]["engine_ms_per_token"]

    def stop(self) -> None:
        pass


class Llama:
    def __init__(self, name: str, gguf: Path, logs: Path):
        self.name = name
        self.bytes = gguf_bytes(gguf)
        self.server = servers.llama_started(name, gguf, 1, 1024,
                                            log=logs / f"roofline-{name}.log")
        prompts = [json.loads(line) for line in (ROOT / "samples" / "prompts" /
                   "peer_prompts.jsonl").read_text().splitlines() if line.strip()]
        self.prompt = " ".join(p["chat"] for p in prompts[:3])

    def ms_per_token(self) -> float:
        body = {"prompt": self.prompt, "n_predict": NEW_TOKENS, "temperature": 0,
                "cache_prompt": False, "ignore_eos": True}
        runs = [httpx.post(f"{self.server.url}/completion", json=body, timeout=600).json()
                ["timings"]["predicted_per_token_ms"] for _ in range(3)]
        return statistics.median(runs)

    def stop(self) -> None:
        self.server.stop()


def table(report: dict) -> list[str]:
    bw = report["read_gb_per_s"]
    lines = [f"memory read bandwidth: {bw:.1f} GB/s on {report['threads']} threads "
             f"({report['read_gb_per_s_one_thread']:.1f} on one), best of 5 over 1 GiB", "",
             "| system | weights read per token | ceiling tok/s | decode tok/s | of the ceiling |",
             "|---|---|---|---|---|"]
    for name, s in report["systems"].items():
        lines.append(f"| {name} | {s['bytes'] / 1e6:.1f} MB | {s['ceiling_tok_s']:.0f} | "
                     f"{s['tok_s']:.1f} | {s['of_ceiling']:.0%} |")
    lines.append("")
    for ours, peer in SAME_WEIGHTS:
        a, b = report["systems"].get(ours), report["systems"].get(peer)
        if a and b:
            lines.append(f"{ours} / {peer}: {a['tok_s'] / b['tok_s']:.2f}x measured; "
                         f"{a['ceiling_tok_s'] / b['tok_s']:.2f}x if {ours} reached its ceiling")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", nargs="+", default=[*DSRUN, *LLAMA],
                   choices=[*DSRUN, *LLAMA])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    measured = revision()
    threads = os.cpu_count() or 1
    logs = ROOT / "build" / "reports" / "serving_logs"
    logs.mkdir(parents=True, exist_ok=True)
    for name in args.systems:
        if name in DSRUN and not DSRUN[name].exists():
            sys.exit(f"{DSRUN[name]} is missing: run `make demo` and "
                     "`python bench/bench_peers.py --setup`")
    systems = []
    try:
        for name in args.systems:
            log(f"starting {name} ...")
            systems.append(Dsrun(name, DSRUN[name]) if name in DSRUN
                           else Llama(name, LLAMA[name](), logs))
        bandwidth, ms = [], {s.name: [] for s in systems}
        for r in range(args.rounds):
            bandwidth.append(read_bandwidth(threads))
            for s in systems[r % len(systems):] + systems[:r % len(systems)]:
                ms[s.name].append(s.ms_per_token())
                log(f"round {r + 1}/{args.rounds}: {s.name} {ms[s.name][-1]:.2f} ms/token")
        one_thread = read_bandwidth(1)
    finally:
        for s in systems:
            s.stop()
    bw = statistics.median(bandwidth)
    report = {"cpu": cpu_line(args.systems) + servers.no_repack_note(), "revision": measured,
              "threads": threads,
              "read_gb_per_s": bw, "read_gb_per_s_rounds": bandwidth,
              "read_gb_per_s_one_thread": one_thread, "systems": {}}
    for s in systems:
        tok_s = 1000 / statistics.median(ms[s.name])
        ceiling = bw * 1e9 / s.bytes
        report["systems"][s.name] = {"bytes": s.bytes, "ms_per_token": ms[s.name],
                                     "tok_s": tok_s, "ceiling_tok_s": ceiling,
                                     "of_ceiling": tok_s / ceiling}
    print("\n".join([report["cpu"], *table(report)]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
