"""Soak over loopback: N clients for M minutes of mixed traffic against `dsrun serve`.

Each client sends requests back to back, each one drawn (seeded) from the mix: streaming or
not, speculation on (hybrid, lookup or draft model) or off, greedy or sampled (seeded),
now and then JSON mode. Every --every seconds it prints the requests done, errors, the
server's RSS and the KV arena's occupancy (from /metrics); at the end the totals, latency
p50/p99 per kind, and the RSS slope and spread after the first minute (allocations that
settle early are not a leak).

    python samples/soak.py --bundle build/smollm2.dsmodel --clients 8 --minutes 10
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from load_test import percentile, rss_mb, start_server

METHODS = ("hybrid", "lookup", "draft")


def draw(rng: random.Random, model: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    stream = rng.random() < 0.5
    spec = rng.random() < 0.75
    sampled = rng.random() < 0.3
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "stream": stream, "speculative_decoding": spec,
            "temperature": 0.8 if sampled else 0}
    if sampled:
        body["seed"] = rng.randrange(2**31)
    if spec:
        body["speculative_config"] = {"method": rng.choice(METHODS)}
    if rng.random() < 0.1:
        body["response_format"] = {"type": "json_object"}
    kind = (f"{'stream' if stream else 'whole'} {'spec' if spec else 'plain'} "
            f"{'sampled' if sampled else 'greedy'}")
    return kind, body


async def one(client: httpx.AsyncClient, url: str, body: dict) -> str | None:
    """None, or what went wrong."""
    if body["stream"]:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return f"HTTP {r.status_code}"
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            if not lines or lines[-1] != "data: [DONE]" or '"error"' in lines[-2]:
                return "stream did not end cleanly"
            return None
    r = await client.post(f"{url}/v1/chat/completions", json=body)
    return None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:80]}"


async def clients(url: str, model: str, prompts: list[str], n: int, seconds: float,
                  max_tokens: int, log: list) -> None:
    end = time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=n + 4)) as c:
        async def worker(i: int) -> None:
            rng = random.Random(i)
            while time.perf_counter() < end:
                kind, body = draw(rng, model, rng.choice(prompts), max_tokens)
                t0 = time.perf_counter()
                try:
                    error = await one(c, url, body)
                except httpx.HTTPError as e:
                    error = type(e).__name__
                log.append((kind, time.perf_counter() - t0, error))
        await asyncio.gather(*(worker(i) for i in range(n)))


def arena_usage(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("dspar_kv_cache_usage_ratio"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def main() -> None:
    from dspark.runtime.sequence.prompt import load_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=Path("build/smollm2.dsmodel"))
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--every", type=float, default=30)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    proc, url = start_server(args.bundle, 32)
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    prompts = [x["chat"] for x in load_prompts(None) if "chat" in x]
    log: list = []
    load = threading.Thread(target=lambda: asyncio.run(clients(
        url, model, prompts, args.clients, args.minutes * 60, args.max_tokens, log)))
    samples = []  # (seconds, RSS MiB, arena usage)
    try:
        load.start()
        t0 = time.perf_counter()
        while load.is_alive():
            samples.append((time.perf_counter() - t0, rss_mb(proc.pid), arena_usage(url)))
            errors = sum(e is not None for *_, e in log)
            print(f"t={samples[-1][0]:5.0f}s requests {len(log):5d} errors {errors} RSS "
                  f"{samples[-1][1]:.0f} MiB arena {samples[-1][2]:.2f}", flush=True)
            load.join(timeout=args.every)
        idle = arena_usage(url)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    errors = [e for *_, e in log if e is not None]
    print(f"{len(log)} requests in {args.minutes:g} min x {args.clients} clients, "
          f"{len(errors)} errors{': ' + '; '.join(sorted(set(errors))[:5]) if errors else ''}")
    for kind in sorted({k for k, *_ in log}):
        t = [s for k, s, e in log if k == kind and e is None]
        print(f"  {kind:24} {len(t):5d} requests, latency p50 {percentile(t, 0.5):6.2f} s, "
              f"p99 {percentile(t, 0.99):6.2f} s")
    steady = [(s, rss) for s, rss, _ in samples if s >= 60] or [(s, r) for s, r, _ in samples]
    times, rss = np.array([s for s, _ in steady]), np.array([r for _, r in steady])
    slope = np.polyfit(times / 60, rss, 1)[0] if len(steady) > 1 else 0.0
    print(f"RSS after the first minute: {rss.min():.0f}-{rss.max():.0f} MiB, drift "
          f"{100 * (rss.max() - rss.min()) / rss.mean():.1f}%, slope {slope:+.2f} MiB/min; "
          f"arena occupancy peak {max(a for *_, a in samples):.2f}, after the load {idle:.2f}")


if __name__ == "__main__":
    main()
