"""Verify attention on a GPU: the DSpark kernel vs torch SDPA over a gathered cache, and the
HBM bandwidth it achieves as a fraction of the device's peak.

For each geometry (a 7B-like GQA model: 32 heads / 8 KV heads x 128; SmolLM2: 9 / 3 x 64),
batch (1, 16), context (512, 4k, 16k) and window (1, 4, 8), in fp16 on a paged arena with
shuffled blocks, it times with CUDA events (median of --iters after --warmup):

    dspark    kv_inject + verify_attention (the runtime's per-layer work; split KV when few
              sequences leave the GPU idle), cubin-free JIT of the same rendered source
    inject    kv_inject alone (its share: fused vs separate is decided by this number)
    sdpa      torch SDPA over each sequence's cache gathered into contiguous [kv, L, d]
              (the gather not timed: SDPA's best case) with a causal window mask
and reports bytes moved / time (K and V of every cached token once, plus q and out) against
the peak (--peak-gbs, else a table of known devices). Prints a table, --json writes it.
Goal (issue 4): >= 80% of peak at window 8, 4k context.

    python bench/bench_kernels.py [--json build/bench/kernels.json]
CPU-only machines cannot run it (it says so and exits 2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

PEAK_GBS = {"H200": 4800, "H100 SXM": 3350, "H100 PCIe": 2000, "H100": 3350,
            "A100-SXM4-80GB": 2039, "A100-SXM4-40GB": 1555, "A100": 1555, "L4": 300,
            "A10": 600, "RTX 4090": 1008}
GEOMETRIES = {"7B-GQA": (128, 32, 8), "SmolLM2": (64, 9, 3)}


def peak_for(name: str) -> float | None:
    for key, gbs in PEAK_GBS.items():
        if key.lower() in name.lower():
            return gbs
    return None


def timed(fn, warmup: int, iters: int) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)  # ms


def build_case(dims: tuple[int, int, int], batch: int, context: int, window: int,
               block: int, device, library_for) -> dict:
    """The three timed functions over one paged fp16 arena, and the kernel's max error
    against SDPA. `library_for(spec)` gives the KernelLibrary (JIT on a GPU; the CPU
    interpreter in the smoke test)."""
    import torch
    import torch.nn.functional as F

    from dspark.kernels.kv_cache import kv_inject
    from dspark.kernels.spec import KernelSpec
    from dspark.kernels.verify_attention import verify_attention

    dev, dt = device, torch.float16
    head_dim, heads, kv = dims
    spec = KernelSpec(head_dim, heads, kv, block, "float16")
    library = library_for(spec)
    per_seq = -(-(context + window) // block)
    num_blocks = batch * per_seq
    k_pool = torch.randn(num_blocks, kv, block, head_dim, device=dev, dtype=dt)
    v_pool = torch.randn_like(k_pool)
    tables = torch.randperm(num_blocks, device=dev).view(batch, per_seq).to(torch.int32)
    i32 = lambda x: torch.tensor(x, device=dev, dtype=torch.int32)  # noqa: E731
    start, new = i32([context] * batch), i32([window] * batch)
    qoff = i32([i * window for i in range(batch)])
    tokens = batch * window
    q = torch.randn(tokens, heads, head_dim, device=dev, dtype=dt)
    k_new = torch.randn(tokens, kv, head_dim, device=dev, dtype=dt)
    v_new = torch.randn_like(k_new)
    pos = torch.arange(context, context + window, device=dev)
    slot_block = torch.stack([tables[s, pos // block] for s in range(batch)]).flatten()
    slot_offset = (pos % block).repeat(batch).to(torch.int32)
    out = torch.empty_like(q)
    length, scale = context + window, head_dim ** -0.5

    def inject() -> None:
        kv_inject(k_new, v_new, k_pool, v_pool, slot_block, slot_offset, library)

    def dspark() -> None:
        inject()
        verify_attention(q, k_pool, v_pool, tables, start, new, qoff, scale, library,
                         max_new=window, max_len=length, out=out)

    dspark()  # the cache now holds the window's K/V: gather it for SDPA
    def gather(pool, s):
        return pool[tables[s].long()].transpose(0, 1).reshape(kv, -1, head_dim)[:, :length]
    gathered = [(gather(k_pool, s), gather(v_pool, s)) for s in range(batch)]
    mask = (torch.arange(length, device=dev)[None, :]
            <= (context + torch.arange(window, device=dev))[:, None])
    qs = q.view(batch, window, heads, head_dim).transpose(1, 2)  # [batch, heads, window, d]

    def sdpa_one(s: int):
        keys, values = gathered[s]
        return F.scaled_dot_product_attention(qs[s:s + 1], keys[None], values[None],
                                              attn_mask=mask, scale=scale, enable_gqa=True)

    def sdpa() -> None:
        for s in range(batch):
            sdpa_one(s)

    want = torch.cat([sdpa_one(s)[0].transpose(0, 1) for s in range(batch)])
    error = float((out.float() - want.float()).abs().max())
    moved = 2 * batch * kv * length * head_dim * 2 + 2 * q.numel() * 2  # K+V, q+out (bytes)
    return {"dspark": dspark, "inject": inject, "sdpa": sdpa, "max_abs_err": error,
            "bytes": moved}


def case(geometry: str, batch: int, context: int, window: int, block: int, warmup: int,
         iters: int, cache_dir: str) -> dict:
    import torch

    from dspark.kernels.library import KernelLibrary

    built = build_case(GEOMETRIES[geometry], batch, context, window, block,
                       torch.device("cuda"), lambda spec: KernelLibrary(spec, cache_dir))
    t = {name: timed(built[name], warmup, iters) for name in ("dspark", "inject", "sdpa")}
    return {"geometry": geometry, "batch": batch, "context": context, "window": window,
            "block": block, "ms": t, "gbs": built["bytes"] / (t["dspark"] * 1e-3) / 1e9,
            "sdpa_gbs": built["bytes"] / (t["sdpa"] * 1e-3) / 1e9,
            "max_abs_err": built["max_abs_err"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="512,4096,16384")
    ap.add_argument("--windows", default="1,4,8")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--peak-gbs", type=float, help="device HBM peak (default: known table)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        sys.exit(2)
    name = torch.cuda.get_device_name()
    peak = args.peak_gbs or peak_for(name)
    rows = []
    cache_dir = tempfile.mkdtemp(prefix="dspark-bench-kernels-")
    print(f"{name}, peak {peak or '?'} GB/s, fp16, block {args.block}")
    print(f"{'geometry':8} {'batch':>5} {'ctx':>6} {'w':>2} {'dspark ms':>10} {'inject':>7} "
          f"{'sdpa ms':>8} {'GB/s':>7} {'of peak':>7} {'vs sdpa':>7} {'err':>8}")
    for geometry in GEOMETRIES:
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                for window in map(int, args.windows.split(",")):
                    r = case(geometry, batch, context, window, args.block, args.warmup,
                             args.iters, cache_dir)
                    r["of_peak"] = r["gbs"] / peak if peak else None
                    rows.append(r)
                    frac = f"{r['of_peak']:.0%}" if peak else "?"
                    print(f"{geometry:8} {batch:5} {context:6} {window:2} "
                          f"{r['ms']['dspark']:10.4f} {r['ms']['inject']:7.4f} "
                          f"{r['ms']['sdpa']:8.4f} {r['gbs']:7.0f} {frac:>7} "
                          f"{r['ms']['sdpa'] / r['ms']['dspark']:6.2f}x "
                          f"{r['max_abs_err']:8.1e}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps({"device": name, "peak_gbs": peak, "rows": rows}, indent=1))
        tmp.rename(args.json)


if __name__ == "__main__":
    main()
