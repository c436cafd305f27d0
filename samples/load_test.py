"""Load test over loopback: N concurrent streaming clients for a fixed duration.

Starts `dsrun serve` on the bundle (or uses --url), then for speculation on and off and each
client count runs N clients that each send chat requests (the shipped bench prompts, greedy,
--max-tokens each) back to back for --duration seconds, streaming. Prints per setting:
completed requests, output tokens/s, TTFT p50/p99, per-request mean inter-token latency
p50/p99, errors; and the server's RSS at start, end and peak.

    python samples/load_test.py --bundle build/smollm2.dsmodel --clients 1,8,32 --duration 60
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

from dspark.runtime.server.ports import free_port


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                      max_tokens: int, speculative: bool) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "speculative_decoding": speculative}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"error": f"HTTP {r.status_code}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
    if first is None:
        return {"error": "no tokens"}
    itl = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    return {"ttft": first - t0, "itl": itl, "tokens": tokens}


async def run_clients(url: str, model: str, prompts: list[str], n: int, duration: float,
                      max_tokens: int, speculative: bool) -> dict:
    end = time.perf_counter() + duration
    results: list[dict] = []
    limits = httpx.Limits(max_connections=n + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def worker(i: int) -> None:
            rng = random.Random(i)
            while time.perf_counter() < end:
                try:
                    results.append(await one_request(client, url, model, rng.choice(prompts),
                                                     max_tokens, speculative))
                except httpx.HTTPError as e:
                    results.append({"error": type(e).__name__})
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(n)))
        elapsed = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    return {"clients": n, "speculative": speculative, "requests": len(ok),
            "errors": len(results) - len(ok),
            "tokens_per_s": sum(r["tokens"] for r in ok) / elapsed,
            "ttft_p50_ms": 1000 * percentile([r["ttft"] for r in ok], 0.5),
            "ttft_p99_ms": 1000 * percentile([r["ttft"] for r in ok], 0.99),
            "itl_p50_ms": 1000 * percentile([r["itl"] for r in ok], 0.5),
            "itl_p99_ms": 1000 * percentile([r["itl"] for r in ok], 0.99)}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def start_server(bundle: Path, max_batch: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    dsrun = Path(sys.executable).parent / "dsrun"
    proc = subprocess.Popen([str(dsrun), "serve", "--model", str(bundle), "--port", str(port),
                             "--max-batch", str(max_batch)])
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("server did not start")


def main() -> None:
    from dspark.runtime.sequence.prompt import load_prompts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, default=Path("build/smollm2.dsmodel"))
    p.add_argument("--url", help="an already running server")
    p.add_argument("--clients", default="1,8,32")
    p.add_argument("--duration", type=float, default=60)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    proc, url = (None, args.url) if args.url else start_server(args.bundle, args.max_batch)
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    prompts = [x["chat"] for x in load_prompts(None) if "chat" in x]
    rss = [rss_mb(proc.pid)] if proc else []
    rows = []
    try:
        for n in (int(x) for x in args.clients.split(",")):
            for spec in (True, False):
                rows.append(asyncio.run(run_clients(url, model, prompts, n, args.duration,
                                                    args.max_tokens, spec)))
                if proc:
                    rss.append(rss_mb(proc.pid))
                row = rows[-1]
                print(f"clients {n:>3} spec {'on ' if spec else 'off'}: {row['requests']:>5} "
                      f"requests, {row['tokens_per_s']:7.1f} tok/s, TTFT p50/p99 "
                      f"{row['ttft_p50_ms']:6.0f}/{row['ttft_p99_ms']:6.0f} ms, ITL p50/p99 "
                      f"{row['itl_p50_ms']:5.1f}/{row['itl_p99_ms']:5.1f} ms, errors "
                      f"{row['errors']}", flush=True)
    finally:
        if proc:
            proc.terminate()
            proc.wait(timeout=30)
    if rss:
        print(f"server RSS: start {rss[0]:.0f} MiB, end {rss[-1]:.0f} MiB, peak {max(rss):.0f} MiB")
    if args.json:
        print(json.dumps({"rows": rows, "rss_mb": rss}))


if __name__ == "__main__":
    main()
