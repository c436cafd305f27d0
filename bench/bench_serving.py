"""Serving under load: N streaming clients for a fixed time, dsrun beside llama-server on the
same weights, in one interleaved run.

    python bench/bench_serving.py --json build/reports/serving.json

Each client sends held-out chat prompts (samples/prompts/peer_prompts.jsonl) back to back,
greedy, --max-tokens each, streaming, for --duration seconds, with `cache_prompt: false`:
the 12 prompts stand for distinct users' prompts, so no server reuses one it has seen. (With
the caches on, whichever row ran first on a server paid its cold prompts, and they set that
row's TTFT p99; --cache-prompts keeps both servers' caches.) A 429 is retried as the OpenAI
SDK retries it: the same request after retry-after-ms (else Retry-After), its
x-stainless-retry-count header counting the retries, at most twice; a third 429 fails the
call and the client goes on (no wait runs past the setting's end). Per system and client
count: output tok/s (and each round's), TTFT and ITL (each request's mean time per token
after its first) at p50 and p99, requests, 429s and the calls they failed, a call's TTFT
p99 from its first attempt (its 429s' waits included), the clients that had a request served
and the fewest any client had (under overload: whether the queue starves some), other
errors, and the server's RSS (at start, at its peak during the setting). Systems:

    dsrun-fp32  dsrun-q4     the README sample and its int4 main (plain: each request with
                             speculative_decoding false; default: speculation on), one
                             server each, --max-batch 16 --max-queue 32
    llama-f32   llama-q4_1   llama-server with -np 16 slots (started again with --no-repack
                             where its repacked Q4_1 path crashes loading; the report says so)
Every setting runs every system in turn, in --rounds rounds (the order rotating by setting
and round), so that a noisy minute on a shared machine falls on all of them. A greedy request's
text under load is compared with the same prompt served alone (the 1-client setting): the
`same` column. The report starts with the CPU's model and flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import servers
from servers import ROOT, percentile, stream_chat

PROMPTS = ROOT / "samples" / "prompts" / "peer_prompts.jsonl"
DSRUN = {"dsrun-fp32": ROOT / "build" / "smollm2.dsmodel",
         "dsrun-q4": ROOT / "build" / "smollm2-q4.dsmodel"}
SYSTEMS = ("dsrun-fp32", "dsrun-q4", "llama-f32", "llama-q4_1")
SLOTS, QUEUE = 16, 32
SDK_RETRIES = 2  # the OpenAI SDK's default max_retries


def log(msg: str) -> None:
    print(f"[serving] {msg}", file=sys.stderr, flush=True)


def start(name: str, logs: Path) -> servers.Server:
    import peer_setup as setup

    log(f"starting {name} ...")
    if name in DSRUN:
        if not DSRUN[name].exists():
            sys.exit(f"{DSRUN[name]} is missing: run `make demo` and "
                     "`python bench/bench_peers.py --setup`")
        return servers.dsrun(name, DSRUN[name], "--max-batch", str(SLOTS), "--max-queue",
                             str(QUEUE), log=logs / f"{name}.log")
    gguf = setup.GGUF["f32"] if name == "llama-f32" else setup.q41_gguf()
    return servers.llama_started(name, gguf, SLOTS, 1024, log=logs / f"{name}.log")


async def run_clients(server: servers.Server, prompts: list[dict], clients: int,
                      duration: float, max_tokens: int, extra: dict) -> dict:
    """`clients` streaming clients for `duration` seconds; `extra`: fields every request
    adds (a mode, cache_prompt)."""
    end = time.perf_counter() + duration
    replies: list[dict] = []
    rss = [server.rss_mb()]
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one(i: int) -> None:
            rng = random.Random(i)
            while time.perf_counter() < end:
                p = rng.choice(prompts)
                messages = [{"role": "user", "content": p["chat"]}]
                called = time.perf_counter()
                for attempt in range(SDK_RETRIES + 1):  # a call, as the OpenAI SDK makes it
                    sent = time.perf_counter()
                    reply = await stream_chat(
                        client, server, messages, max_tokens,
                        headers={"x-stainless-retry-count": str(attempt)}, **extra)
                    replies.append({
                        "client": i, "prompt": p["name"], "status": reply.status,
                        "error": reply.error, "ttft": reply.ttft, "attempt": attempt,
                        "sent": sent - called, "retry_after": reply.retry_after,
                        "call_ttft": None if reply.ttft is None
                        else reply.ttft + sent - called,
                        "tokens": reply.completion_tokens, "text": reply.text,
                        "itl": _itl(reply)})
                    wait = reply.retry_after or 1.0
                    if reply.status != 429 or attempt == SDK_RETRIES:
                        break
                    if time.perf_counter() + wait > end:
                        return  # a wait past the setting's end: the client stops there (sent
                        # early instead, cut to the end, a retry was refused as early)
                    await asyncio.sleep(wait)

        async def watch() -> None:
            while time.perf_counter() < end:
                rss.append(server.rss_mb())
                await asyncio.sleep(1.0)
        t0 = time.perf_counter()
        await asyncio.gather(watch(), *(one(i) for i in range(clients)))
        elapsed = time.perf_counter() - t0
    return {"replies": replies, "seconds": elapsed, "rss_start": rss[0], "rss_peak": max(rss)}


def _itl(reply) -> float | None:
    if reply.ttft is None or len(reply.times) < 2 or reply.completion_tokens < 2:
        return None
    return (reply.times[-1] - reply.times[0]) / (reply.completion_tokens - 1)


def summarise(run: dict, clients: int, alone: dict[str, str] | None) -> dict:
    ok = [r for r in run["replies"] if r["error"] is None]
    ttft = [1000 * r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [1000 * r["itl"] for r in ok if r["itl"] is not None]
    same = None if alone is None else all(
        r["text"] == alone[r["prompt"]] for r in ok if r["prompt"] in alone)
    call_ttft = [1000 * r["call_ttft"] for r in ok if r.get("call_ttft") is not None]
    served = Counter(r.get("client") for r in ok)
    return {"requests": len(ok), "tokens_per_s": sum(r["tokens"] for r in ok) / run["seconds"],
            "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p99_ms": percentile(ttft, 0.99),
            # from a call's first attempt: its 429s' waits included
            "call_ttft_p99_ms": percentile(call_ttft, 0.99),
            "itl_p50_ms": percentile(itl, 0.5), "itl_p99_ms": percentile(itl, 0.99),
            "rejected_429": sum(r["status"] == 429 for r in run["replies"]),
            # overload's fairness: the clients that had at least one request served
            "clients_served": len(served),
            "fewest_served": min(served.get(i, 0) for i in range(clients)),
            # calls that still had a 429 after the SDK's retries
            "calls_refused": sum(r["status"] == 429 and r.get("attempt") == SDK_RETRIES
                                 for r in run["replies"]),
            "errors_5xx": sum(500 <= r["status"] < 600 for r in run["replies"]),
            "other_errors": sum(r["error"] is not None and r["status"] != 429
                                and not 500 <= r["status"] < 600 for r in run["replies"]),
            "rss_start_mb": run["rss_start"], "rss_peak_mb": run["rss_peak"], "same": same,
            "round_tokens_per_s": [round(r, 1) for r in run.get("round_rates", [])]}


def merge(runs: dict[str, dict], key: str, run: dict) -> None:
    """Add a round's run to the setting's runs so far (replies pooled, seconds summed, RSS
    from the first round's start to the highest peak, each round's tok/s kept: how far
    the rounds of one row spread is the noise a ratio between rows carries)."""
    rate = sum(r["tokens"] for r in run["replies"] if r["error"] is None) / run["seconds"]
    if key not in runs:
        runs[key] = {**run, "round_rates": [rate]}
        return
    old = runs[key]
    runs[key] = {"replies": old["replies"] + run["replies"],
                 "seconds": old["seconds"] + run["seconds"], "rss_start": old["rss_start"],
                 "rss_peak": max(old["rss_peak"], run["rss_peak"]),
                 "round_rates": old["round_rates"] + [rate]}


def modes(name: str) -> list[tuple[str, dict]]:
    """(row name, request fields) of a system: dsrun's plain and default, a peer's one."""
    if name in DSRUN:
        return [(f"{name} plain", {"speculative_decoding": False}), (f"{name} default", {})]
    return [(name, {})]


def table(report: dict) -> list[str]:
    lines = ["| system | clients | tok/s (each round) | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
             "requests | 429s (calls refused) | call TTFT p99 ms | clients served (fewest "
             "requests) | 5xx | RSS start / peak MiB | same as alone |", "|---" * 12 + "|"]
    for key, s in report["results"].items():
        name, clients = key.rsplit("@", 1)
        same = {True: "yes", False: "NO", None: "-"}[s["same"]]
        rounds = ", ".join(f"{r:.0f}" for r in s.get("round_tokens_per_s", []))
        lines.append(
            f"| {name} | {clients} | {s['tokens_per_s']:.0f} ({rounds}) | {s['ttft_p50_ms']:.0f} / "
            f"{s['ttft_p99_ms']:.0f} | {s['itl_p50_ms']:.1f} / {s['itl_p99_ms']:.1f} | "
            f"{s['requests']} | {s['rejected_429']} ({s.get('calls_refused', '-')}) | "
            f"{s.get('call_ttft_p99_ms', float('nan')):.0f} | "
            f"{s.get('clients_served', '-')} ({s.get('fewest_served', '-')}) | "
            f"{s['errors_5xx']} | "
            f"{s['rss_start_mb']:.0f} / {s['rss_peak_mb']:.0f} | {same} |")
    return lines


def main() -> None:
    from bench_peers import cpu_line
    from revision import revision

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    p.add_argument("--clients", default="1,4,16,64")
    p.add_argument("--duration", type=float, default=60)
    p.add_argument("--rounds", type=int, default=3, help="each setting's duration split into "
                   "this many rounds, the systems interleaved round by round")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--cache-prompts", action="store_true", help="let the servers reuse the "
                   "prompts they cached (default: every request pays its whole prompt)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    measured = revision()
    prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    counts = [int(c) for c in args.clients.split(",")]
    logs = ROOT / "build" / "reports" / "serving_logs"
    logs.mkdir(parents=True, exist_ok=True)
    running = {n: start(n, logs) for n in args.systems}
    rows = [(row, n, extra) for n in args.systems for row, extra in modes(n)]
    runs: dict[str, dict] = {}
    caching = {} if args.cache_prompts else {"cache_prompt": False}  # both servers' field
    try:
        for i, clients in enumerate(counts):
            for r in range(args.rounds):
                k = (i + r) % len(rows)
                for row, name, extra in rows[k:] + rows[:k]:
                    log(f"{clients} clients, round {r + 1}/{args.rounds}: {row}")
                    merge(runs, f"{row}@{clients}", asyncio.run(run_clients(
                        running[name], prompts, clients, args.duration / args.rounds,
                        args.max_tokens, {**extra, **caching})))
    finally:
        for server in running.values():
            server.stop()
    alone = {row: {r["prompt"]: r["text"] for r in runs[f"{row}@{counts[0]}"]["replies"]
                   if r["error"] is None} for row, _, _ in rows} if counts[0] == 1 else {}
    report = {"cpu": cpu_line(args.systems), "revision": measured,
              "setup": (f"SmolLM2-135M-Instruct; {args.duration:.0f} s per setting in "
                        f"{args.rounds} interleaved rounds, "
                        f"{args.max_tokens} tokens a request, greedy, "
                        f"{'prompts cached' if args.cache_prompts else 'no prompt cached'}; "
                        f"dsrun --max-batch "
                        f"{SLOTS} --max-queue {QUEUE}; llama-server -np {SLOTS}"
                        + servers.no_repack_note()),
              "results": {f"{row}@{c}": summarise(runs[f"{row}@{c}"], c, alone.get(row))
                          for c in counts for row, _, _ in rows}}
    print("\n".join([report["cpu"], report["setup"], "", *table(report)]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**report, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
