"""Multi-turn chats under long shared system prompts: TTFT cold and warm, prefix hit rate and
tok/s; dsrun (prefix cache on, and off) beside llama-server (cache_prompt on, -np slots) on
the same weights, in one interleaved run.

    python bench/bench_multi_turn.py --json build/reports/multi_turn.json

The workload (seeded, the same for every server): --users conversations of 4-8 turns, each
under one of three system prompts of about 500, 1300 and 2800 tokens (this repository's
docs), a question a turn, greedy replies of --max-tokens. --concurrency users talk at once,
each sending its next turn when its reply is complete; each value is a setting. Every
repetition puts a new first line in the system prompts, so each server meets every prompt
cold once per repetition. A user's first turn is "cold" when it brings its system prompt to
the server first, "shared" when another user brought it, and later turns are "warm". The
servers take turns, setting by setting, in an order that rotates every repetition. The
report starts with the CPU's model and flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import servers
from servers import ROOT, Reply, percentile, stream_chat

SAMPLE = ROOT / "build" / "smollm2"
BUNDLE_4K = ROOT / "build" / "smollm2-4k.dsmodel"  # the sample at 4096 positions
SYSTEM_TOKENS = (500, 1300, 2800)
DOCS = ("architecture.md", "runtime.md", "drafting.md", "serving.md", "models.md")
QUESTIONS = [
    "What does the compiler do first?", "How is the KV cache laid out?",
    "Summarise the drafting policy in two sentences.", "What happens when a request is bad?",
    "Which models are refused, and why?", "How are metrics exposed?",
    "What is the DFlash scheduler?", "How does speculation stay lossless?",
    "Give one example of a command line.", "What does the bundle contain?",
    "How does the server shut down?", "What is a verify window?",
    "Why segment the model?", "What is the hybrid drafter?", "Name two metrics.",
    "How are prompts fed when several tenants are active?",
]
SYSTEMS = ("dsrun-fp32", "dsrun-fp32-nocache", "llama-f32")


def log(msg: str) -> None:
    print(f"[multi-turn] {msg}", file=sys.stderr, flush=True)


def ensure_bundle() -> None:
    if BUNDLE_4K.exists():
        return
    if not (SAMPLE / "main.onnx").exists():
        sys.exit("run `make demo` first (build/smollm2)")
    log("compiling the sample at 4096 positions ...")
    subprocess.run([Path(sys.executable).parent / "dsc", "compile", SAMPLE / "main.onnx",
                    SAMPLE / "draft.onnx", "-o", BUNDLE_4K, "--max-seq-len", "4096",
                    "--force"], check=True)


def system_prompts(salt: str) -> list[str]:
    """Three prompts of about SYSTEM_TOKENS tokens of the docs, each opening with `salt`."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(BUNDLE_4K / "tokenizer" / "tokenizer.json"))
    text = "\n\n".join((ROOT / "docs" / page).read_text() for page in DOCS)
    ids = tok.encode(text).ids
    head = f"Session {salt}. You answer questions about DSpark from its documentation:\n\n"
    return [head + tok.decode(ids[:n]) for n in SYSTEM_TOKENS]


def conversations(users: int, seed: int) -> list[tuple[int, list[str]]]:
    """Per user: its system prompt's index and its questions (4-8 turns)."""
    rng = random.Random(seed)
    return [(u % len(SYSTEM_TOKENS), rng.sample(QUESTIONS, rng.randint(4, 8)))
            for u in range(users)]


async def run_setting(server: servers.Server, prompts: list[str], chats, concurrency: int,
                      max_tokens: int) -> dict:
    """Every conversation, `concurrency` users at a time; each turn's record and the wall
    time."""
    records: list[dict] = []
    seen: set[int] = set()
    queue = list(enumerate(chats))
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def user() -> None:
            while queue:
                uid, (system, questions) = queue.pop(0)
                messages = [{"role": "system", "content": prompts[system]}]
                for turn, question in enumerate(questions):
                    kind = "warm" if turn else ("shared" if system in seen else "cold")
                    seen.add(system)
                    messages.append({"role": "user", "content": question})
                    reply = await stream_chat(client, server, messages, max_tokens)
                    records.append(_record(reply, uid, turn, system, kind))
                    messages.append({"role": "assistant", "content": reply.text})
        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
    return {"records": records, "seconds": time.perf_counter() - t0}


def _record(reply: Reply, uid: int, turn: int, system: int, kind: str) -> dict:
    return {"user": uid, "turn": turn, "system": system, "kind": kind, "ttft": reply.ttft,
            "prompt": reply.prompt_tokens, "cached": reply.cached_tokens,
            "tokens": reply.completion_tokens, "error": reply.error}


def summarise(runs: list[dict]) -> dict:
    recs = [r for run in runs for r in run["records"]]
    ok = [r for r in recs if r["error"] is None]
    timed = [r for r in ok if r["ttft"] is not None]  # an empty reply has no first token
    ms = lambda kind: [1000 * r["ttft"] for r in timed if r["kind"] == kind]  # noqa: E731
    prompt = sum(r["prompt"] for r in ok)
    cached = sum(r["cached"] or 0 for r in ok)
    out = {"requests": len(recs), "errors": len(recs) - len(ok),
           "tokens_per_s": sum(r["tokens"] for r in ok) / sum(run["seconds"] for run in runs),
           "hit_rate": cached / prompt if prompt else 0.0}
    for kind in ("cold", "shared", "warm"):
        out[f"{kind}_p50_ms"] = percentile(ms(kind), 0.5)
        out[f"{kind}_p99_ms"] = percentile(ms(kind), 0.99)
    out["by_system"] = {
        SYSTEM_TOKENS[s]: {kind: percentile([1000 * r["ttft"] for r in timed
                                             if r["system"] == s and r["kind"] == kind], 0.5)
                           for kind in ("cold", "warm")} for s in range(len(SYSTEM_TOKENS))}
    return out


def start(name: str, slots: int, logs: Path) -> servers.Server:
    import peer_setup as setup

    log(f"starting {name} ...")
    if name == "dsrun-fp32":
        return servers.dsrun(name, BUNDLE_4K, log=logs / f"{name}.log")
    if name == "dsrun-fp32-nocache":
        return servers.dsrun(name, BUNDLE_4K, "--no-prefix-cache", log=logs / f"{name}.log")
    if name == "llama-f32":
        return servers.llama(name, setup.GGUF["f32"], slots, 4096, log=logs / f"{name}.log")
    if name == "llama-q4_1":
        return servers.llama(name, setup.q41_gguf(), slots, 4096, "--no-repack",
                             log=logs / f"{name}.log")
    sys.exit(f"unknown system {name!r} (known: {', '.join(SYSTEMS)}, llama-q4_1)")


def table(report: dict) -> list[str]:
    """The report's table (docs/benchmarks.md shows it too)."""
    lines = ["| system | users at once | cold TTFT p50/p99 ms | shared p50/p99 | warm p50/p99 "
             "| warm / cold | hit rate | tok/s | errors |", "|---" * 9 + "|"]
    for key, s in report["results"].items():
        name, conc = key.rsplit("@", 1)
        lines.append(
            f"| {name} | {conc} | {s['cold_p50_ms']:.0f} / {s['cold_p99_ms']:.0f} | "
            f"{s['shared_p50_ms']:.0f} / {s['shared_p99_ms']:.0f} | {s['warm_p50_ms']:.0f} / "
            f"{s['warm_p99_ms']:.0f} | {s['warm_p50_ms'] / s['cold_p50_ms']:.3f}x | "
            f"{s['hit_rate']:.0%} | {s['tokens_per_s']:.1f} | {s['errors']} |")
    lines += ["", "TTFT p50 (ms) by system prompt, one user at a time, cold / warm:", ""]
    for key, s in report["results"].items():
        if key.endswith("@1"):
            lines.append(f"- {key[:-2]}: " + ", ".join(
                f"{n} tokens {v['cold']:.0f} / {v['warm']:.0f} ({v['warm'] / v['cold']:.3f}x)"
                for n, v in s["by_system"].items()))
    return lines


def format_report(report: dict) -> str:
    return "\n".join([report["cpu"], report["setup"], "", *table(report)])


def main() -> None:
    from bench_peers import cpu_line
    from revision import revision

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    p.add_argument("--users", type=int, default=9)
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    settings = [int(c) for c in args.concurrency.split(",")]
    measured = revision()  # before anything can change the checkout
    ensure_bundle()
    logs = ROOT / "build" / "reports" / "multi_turn_logs"
    logs.mkdir(parents=True, exist_ok=True)
    running = {n: start(n, max(settings), logs) for n in args.systems}
    runs: dict[str, list[dict]] = {f"{n}@{c}": [] for c in settings for n in args.systems}
    try:
        for rep in range(args.repeats):
            for conc in settings:
                order = args.systems[rep % len(args.systems):] + args.systems[
                    :rep % len(args.systems)]
                for name in order:
                    prompts = system_prompts(f"{rep}-{conc}")
                    chats = conversations(args.users, args.seed + rep)
                    log(f"rep {rep}, {conc} at once: {name}")
                    runs[f"{name}@{conc}"].append(asyncio.run(run_setting(
                        running[name], prompts, chats, conc, args.max_tokens)))
    finally:
        for server in running.values():
            server.stop()
    report = {"cpu": cpu_line(args.systems), "revision": measured,
              "setup": (f"SmolLM2-135M-Instruct, fp32 sample compiled at 4096 positions vs "
                        f"llama-server F32 GGUF (-np {max(settings)}, cache_prompt on); "
                        f"{args.users} users x 4-8 turns, system prompts of "
                        f"{'/'.join(map(str, SYSTEM_TOKENS))} tokens, {args.max_tokens} "
                        f"tokens a reply, greedy, {args.repeats} repetition(s)"),
              "results": {k: summarise(v) for k, v in runs.items()}}
    print(format_report(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**report, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
