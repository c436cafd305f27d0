"""The first request after start against steady state: serves the bundle (warm-up on, or
--no-warmup), waits for /health, then times one request and --repeats more of the same.

    python samples/first_request.py --bundle build/smollm2.dsmodel [--no-warmup]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from load_test import start_server


def timed(url: str, model: str) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 32, "temperature": 0}
    t0 = time.perf_counter()
    httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).raise_for_status()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, default=Path("build/smollm2.dsmodel"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-warmup", action="store_true")
    args = p.parse_args()
    if args.no_warmup:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([str(Path(sys.executable).parent / "dsrun"), "serve", "--model",
                                 str(args.bundle), "--port", str(port), "--no-warmup"])
        url = f"http://127.0.0.1:{port}"
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
    else:
        proc, url = start_server(args.bundle, 16)
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        first = timed(url, model)
        steady = statistics.median(timed(url, model) for _ in range(args.repeats))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"first request {first * 1000:.0f} ms, steady state {steady * 1000:.0f} ms "
          f"(ratio {first / steady:.2f}, warm-up {'off' if args.no_warmup else 'on'})")


if __name__ == "__main__":
    main()
