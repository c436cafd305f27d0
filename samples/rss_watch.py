"""Is the server's memory flat under steady load? Serves the bundle, runs N streaming
clients for --minutes, prints the server's RSS every --every seconds and the spread after
the first sample (allocations that settle in the first minute are not a leak).

    python samples/rss_watch.py --bundle build/smollm2.dsmodel --clients 8 --minutes 5
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from pathlib import Path

from load_test import rss_mb, run_clients, start_server


def main() -> None:
    import httpx

    from dspark.runtime.cli.bench import load_prompts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, default=Path("build/smollm2.dsmodel"))
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--minutes", type=float, default=5)
    p.add_argument("--every", type=float, default=30)
    args = p.parse_args()
    proc, url = start_server(args.bundle, 32)
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    prompts = [x["chat"] for x in load_prompts(None) if "chat" in x]
    result = {}
    load = threading.Thread(target=lambda: result.update(asyncio.run(run_clients(
        url, model, prompts, args.clients, args.minutes * 60, 64, True))))
    samples = []
    try:
        load.start()
        t0 = time.perf_counter()
        while load.is_alive():
            samples.append(rss_mb(proc.pid))
            print(f"t={time.perf_counter() - t0:5.0f}s RSS {samples[-1]:.0f} MiB", flush=True)
            load.join(timeout=args.every)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    steady = samples[2:] or samples
    print(f"{result.get('requests')} requests, {result.get('errors')} errors; RSS after the "
          f"first minute: min {min(steady):.0f}, max {max(steady):.0f} MiB "
          f"(spread {max(steady) - min(steady):.0f} MiB)")


if __name__ == "__main__":
    main()
