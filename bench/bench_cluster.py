"""Scale-out on this machine: `dsrun serve` vs `dsrun cluster` with 1 and 2 replicas, the
same streaming chat load against each (one server at a time, alternating order per repeat).

Prints per system and client count: output tokens/s, TTFT p50, ITL p50, errors; then the
cluster's throughput at 2 replicas / 1 replica and the Ray ingress's added p50 TTFT and ITL
(cluster with 1 replica of all cores vs dsrun serve with the same cores).

    python bench/bench_cluster.py --bundle build/smollm2.dsmodel --clients 1,8 --duration 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from dspark.runtime.server.ports import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "samples"))  # its builders
from load_test import run_clients  # noqa: E402

CORES = os.cpu_count() or 1
SYSTEMS = {
    "serve": ["serve"],
    "cluster-1": ["cluster", "--replicas", "1", "--cpus-per-replica", str(CORES)],
    "cluster-2": ["cluster", "--replicas", "2", "--cpus-per-replica", str(max(1, CORES // 2))],
}


def start(system: str, bundle: Path, max_batch: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    dsrun = Path(sys.executable).parent / "dsrun"
    proc = subprocess.Popen([str(dsrun), *SYSTEMS[system], "--model", str(bundle), "--port",
                             str(port), "--max-batch", str(max_batch)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(f"{system} did not start")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    from dspark.runtime.sequence.prompt import load_prompts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, default=Path("build/smollm2.dsmodel"))
    p.add_argument("--clients", default="1,8")
    p.add_argument("--duration", type=float, default=30)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()
    prompts = [x["chat"] for x in load_prompts(None) if "chat" in x]
    systems = args.systems.split(",")
    rows: list[dict] = []
    for repeat in range(args.repeats):
        for system in (systems if repeat % 2 == 0 else systems[::-1]):
            proc, url = start(system, args.bundle, args.max_batch)
            try:
                model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
                asyncio.run(run_clients(url, model, prompts, 1, 5, args.max_tokens, True))
                for n in (int(x) for x in args.clients.split(",")):
                    row = asyncio.run(run_clients(url, model, prompts, n, args.duration,
                                                  args.max_tokens, True))
                    rows.append({"system": system, **row})
                    print(f"{system:>10} clients {n:>3}: {row['tokens_per_s']:7.1f} tok/s, "
                          f"TTFT p50 {row['ttft_p50_ms']:6.1f} ms, ITL p50 "
                          f"{row['itl_p50_ms']:5.1f} ms, {row['requests']} requests, "
                          f"errors {row['errors']}", flush=True)
            finally:
                stop(proc)
    summarize(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


def summarize(rows: list[dict]) -> None:
    def mean(system: str, n: int, key: str) -> float | None:
        xs = [r[key] for r in rows if r["system"] == system and r["clients"] == n]
        return sum(xs) / len(xs) if xs else None

    for n in sorted({r["clients"] for r in rows}):
        one, two = mean("cluster-1", n, "tokens_per_s"), mean("cluster-2", n, "tokens_per_s")
        if one and two:
            print(f"clients {n:>3}: cluster 2 replicas / 1 replica = {two / one:.2f}x tok/s")
        base = {k: mean("serve", n, k) for k in ("ttft_p50_ms", "itl_p50_ms", "tokens_per_s")}
        ray = {k: mean("cluster-1", n, k) for k in base}
        if all(base.values()) and all(ray.values()):
            print(f"clients {n:>3}: Ray ingress adds TTFT p50 "
                  f"{ray['ttft_p50_ms'] - base['ttft_p50_ms']:+.1f} ms, ITL p50 "
                  f"{ray['itl_p50_ms'] - base['itl_p50_ms']:+.2f} ms; tok/s cluster-1 / serve "
                  f"= {ray['tokens_per_s'] / base['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
