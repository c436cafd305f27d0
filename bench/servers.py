"""The servers a serving benchmark runs side by side, on loopback, and one streamed request.

    dsrun(bundle, *flags)            dsrun serve on a free port
    llama(gguf, slots, ctx, *flags)  llama.cpp's llama-server (bench/peer_setup.py builds
                                     it), threads = the core count, `slots` parallel slots
    llama_started(gguf, slots, ctx)  the same, again with --no-repack where its repacked
                                     Q4_1 path crashes loading (NO_REPACK names them)
    stream_chat(client, url, ...)    one streamed chat request: TTFT, token times, usage
Both servers speak OpenAI's chat API; llama-server's final chunk also carries `timings`
(its prompt tokens computed and taken from its cache).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from dspark.runtime.server.ports import free_port

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    model: str = ""

    def rss_mb(self) -> float:
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def wait_ready(server: Server, timeout: float = 300) -> Server:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise SystemExit(f"{server.name} exited with {server.proc.returncode}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                models = httpx.get(f"{server.url}/v1/models", timeout=5).json()["data"]
                server.model = models[0]["id"]
                return server
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.2)
    server.stop()
    raise SystemExit(f"{server.name} did not become ready in {timeout:.0f} s")


def dsrun(name: str, bundle: Path, *flags: str, log: Path | None = None) -> Server:
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "dsrun"), "serve", "--model", str(bundle),
           "--port", str(port), *flags]
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - the server's life
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return wait_ready(Server(name, proc, f"http://127.0.0.1:{port}"))


def llama(name: str, gguf: Path, slots: int, ctx: int, *flags: str,
          log: Path | None = None) -> Server:
    import peer_setup as setup

    port = free_port()
    threads = str(os.cpu_count() or 1)
    cmd = [str(setup.llama_bin() / "llama-server"), "-m", str(gguf), "--port", str(port),
           "-t", threads, "-tb", threads, "-np", str(slots), "-c", str(ctx * slots), *flags]
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - the server's life
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return wait_ready(Server(name, proc, f"http://127.0.0.1:{port}"))


NO_REPACK: set[str] = set()  # llama-server systems that needed --no-repack to start


def llama_started(name: str, gguf: Path, slots: int, ctx: int,
                  log: Path | None = None) -> Server:
    """llama-server, started again with --no-repack where its repacked Q4_1 path crashes
    loading (a segfault on some AVX-512 Xeons); a report names NO_REPACK's systems."""
    try:
        return llama(name, gguf, slots, ctx, log=log)
    except SystemExit as e:
        print(f"{name}: {e}; again with --no-repack", file=sys.stderr, flush=True)
        NO_REPACK.add(name)
        return llama(name, gguf, slots, ctx, "--no-repack", log=log)


def no_repack_note() -> str:
    """The report's words for the systems that ran with --no-repack ("" if none)."""
    return "".join(f"; {n} crashed loading with its repacked path and ran with --no-repack"
                   for n in sorted(NO_REPACK))


@dataclass
class Reply:
    ttft: float | None = None  # seconds to the first content token
    times: list[float] = field(default_factory=list)  # arrival of each content chunk
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # of the prompt, taken from the server's cache
    completion_tokens: int = 0
    error: str | None = None
    status: int = 200
    retry_after: float | None = None  # a 429's wait in seconds (retry-after-ms first)
    retried: bool = False  # sent again on a new connection (see stream_chat)


async def stream_chat(client: httpx.AsyncClient, server: Server, messages: list[dict],
                      max_tokens: int, headers: dict | None = None, **extra) -> Reply:
    """One streamed chat request, greedy; what the client saw of it. A connection the
    server had already closed (its keep-alive ran out: llama-server's after 5 s) fails
    before the request is sent, and is retried once on a new connection (`retried`)."""
    try:
        return await _stream_chat(client, server, messages, max_tokens, headers, **extra)
    except (httpx.RemoteProtocolError, httpx.ConnectError):
        reply = await _stream_chat(client, server, messages, max_tokens, headers, **extra)
        reply.retried = True
        return reply


def retry_wait(headers: httpx.Headers) -> float | None:
    """A refusal's wait as the OpenAI SDK reads it: retry-after-ms, then Retry-After."""
    for name, divisor in (("retry-after-ms", 1000), ("retry-after", 1)):
        try:
            return float(headers[name]) / divisor
        except (KeyError, ValueError):
            continue
    return None


async def _stream_chat(client: httpx.AsyncClient, server: Server, messages: list[dict],
                       max_tokens: int, headers: dict | None, **extra) -> Reply:
    body = {"model": server.model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            **extra}
    reply, t0 = Reply(), time.perf_counter()
    started = False
    try:
        async with client.stream("POST", f"{server.url}/v1/chat/completions",
                                 json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return Reply(error=f"HTTP {r.status_code}", status=r.status_code,
                             retry_after=retry_wait(r.headers))
            async for line in r.aiter_lines():
                started = True
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                _chunk(reply, json.loads(line[6:]), t0)
    except (httpx.RemoteProtocolError, httpx.ConnectError):
        if not started:
            raise
        return Reply(error="connection lost mid-stream", status=0)
    except httpx.HTTPError as e:
        return Reply(error=type(e).__name__, status=0)
    return reply  # an empty reply (EOS first) has no TTFT


def _chunk(reply: Reply, chunk: dict, t0: float) -> None:
    now = time.perf_counter()
    for choice in chunk.get("choices") or ():
        content = (choice.get("delta") or {}).get("content")
        if content:
            reply.ttft = reply.ttft if reply.ttft is not None else now - t0
            reply.times.append(now)
            reply.text += content
    usage = chunk.get("usage")
    if usage:
        reply.prompt_tokens = usage.get("prompt_tokens", 0)
        reply.completion_tokens = usage.get("completion_tokens", 0)
        details = usage.get("prompt_tokens_details") or {}
        if "cached_tokens" in details:
            reply.cached_tokens = details["cached_tokens"]
    timings = chunk.get("timings")
    if timings and "cache_n" in timings:  # llama-server: prompt tokens its cache held
        reply.cached_tokens = timings["cache_n"]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]
