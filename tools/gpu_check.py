"""The GPU proof in one command, for a short lease on a bare CUDA machine.

    python3 tools/gpu_check.py [--out DIR] [--quick]       (make gpu-check)
    python tools/gpu_check.py --prepare                    (here, before the lease)

Uses the machine's own python3 and installs nothing: without an installed `dspark` the
repository is imported through a path shim (it needs torch, Triton, numpy and jinja2 only).
Each step is timed and logged; all of it fits in about eight minutes on an H200:

  1. environment  torch / Triton / onnxruntime versions, the device, its arch, HBM peak
  2. cubins       the ahead-of-time cubins `--prepare` compiled here (build/gpu-check/cubins,
                  carried to the machine) load for this arch, or the exact reason they do not
                  (no cubin for the arch, another Triton), and agree with the reference
  3. kernels      JIT from the rendered sources against the torch reference, on the device:
                  fp32/fp16/bf16 x GQA groups 1/3/4 and SmolLM2's x windows 1/4/8/16 x
                  split-KV off and on, and kv_inject
  4. bench        bench/bench_kernels.py (7B-like GQA and SmolLM2, windows 1/4/8, contexts
                  512/4k/16k, batch 1/16): GB/s and share of the HBM peak against SDPA
  5. lossless     the kernel-level check (tools/gpu_lossless.py): speculative decoding
                  verified by the kernels == plain greedy decoding; and the engine on CUDA
                  (tests/test_gpu.py) where onnxruntime has its CUDA provider, else why not
Writes summary.json and gpu_check.log under --out ($OUT when set, else build/gpu-check) and
prints a short table. Without CUDA it says in one line what it would have run and exits 0;
`--interpret` runs steps 3 and 5 at small sizes under Triton's CPU interpreter instead, and
one of step 4's cases at a tiny size (CI runs that, so the script keeps working between
leases).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
import types
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CUBINS = ROOT / "build" / "gpu-check" / "cubins"
TOLERANCE = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2.5e-2}
# (head_dim, heads, kv heads): GQA groups 1, 3 (SmolLM2) and 4 (7B-like)
GEOMETRIES = {"g1": (64, 8, 8), "smollm2": (64, 9, 3), "7b-gqa": (128, 32, 8)}
CUBIN_SPECS = {"smollm2-fp16": (64, 9, 3, "float16"), "7b-gqa-fp16": (128, 32, 8, "float16"),
               "smollm2-fp32": (64, 9, 3, "float32")}
WOULD_RUN = ("cubin load + check, kernels vs torch reference (fp32/fp16/bf16, GQA 1/3/4, "
             "windows 1/4/8/16, split-KV off/on), bench_kernels, kernel-level lossless")


def import_dspark() -> None:
    """The repository as the `dspark` package when it is not installed (a bare machine)."""
    try:
        import dspark.kernels  # noqa: F401
    except ImportError:
        pkg = types.ModuleType("dspark")
        pkg.__path__ = [str(ROOT)]  # dspark.kernels -> ROOT/kernels, and so on
        sys.modules["dspark"] = pkg


class Log:
    def __init__(self, out: Path):
        self.file = (out / "gpu_check.log").open("w")

    def __call__(self, text: str) -> None:
        print(text, flush=True)
        self.file.write(text + "\n")
        self.file.flush()


def environment(device) -> dict:
    import numpy
    import torch
    import triton

    env = {"python": sys.version.split()[0], "torch": torch.__version__,
           "triton": triton.__version__, "numpy": numpy.__version__, "device": str(device)}
    try:
        import onnxruntime as ort

        env["onnxruntime"] = ort.__version__
        env["onnxruntime_providers"] = ort.get_available_providers()
    except ImportError:
        env["onnxruntime"] = None
    if device.type == "cuda":
        sys.path.insert(0, str(ROOT / "bench"))
        from bench_kernels import peak_for

        major, minor = torch.cuda.get_device_capability(device)
        env.update(name=torch.cuda.get_device_name(device), arch=f"sm_{major}{minor}",
                   peak_gbs=peak_for(torch.cuda.get_device_name(device)),
                   memory_gib=round(torch.cuda.get_device_properties(device).total_memory
                                    / 2**30, 1))
    return env


def _kernel_case(library, dims, window, splits, device, seed) -> float:
    """Max error of verify_attention (three sequences, shuffled blocks) vs the reference."""
    import torch

    from dspark.kernels.verify_attention import verify_attention, verify_attention_reference

    spec = library.spec
    head_dim, heads, kv = dims
    g = torch.Generator().manual_seed(seed)
    bs, blocks = spec.block_size, 64
    starts = [int(torch.randint(0, 3 * bs, (1,), generator=g)) for _ in range(3)]
    if splits > 1:
        starts[1] += 9 * bs  # long enough for its blocks to be split over programs
    news = [window, max(1, window - 1), window]
    need = [-(-(s + n) // bs) for s, n in zip(starts, news)]
    perm = torch.randperm(blocks, generator=g).tolist()
    tables, pos = [], 0
    for n in need:
        tables.append(perm[pos:pos + n] + [0] * (max(need) - n))
        pos += n
    dt = getattr(torch, spec.dtype)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    qoff = [0, news[0], news[0] + news[1]]
    k = torch.randn(blocks, kv, bs, head_dim, generator=g).to(dt)
    v = torch.randn(blocks, kv, bs, head_dim, generator=g).to(dt)
    q = torch.randn(sum(news), heads, head_dim, generator=g).to(dt)
    meta = [i32(tables), i32(starts), i32(news), i32(qoff)]
    want = verify_attention_reference(q.float(), k.float(), v.float(), *meta, head_dim ** -0.5)
    on = [x.to(device) for x in (q, k, v, *meta)]
    got = verify_attention(*on, head_dim ** -0.5, library, splits=splits)
    return float((got.float().cpu() - want).abs().max() / (1 + want.abs().max()))


def check_kernels(device, library_for, quick: bool) -> dict:
    import torch

    from dspark.kernels.kv_cache import kv_inject, kv_inject_reference
    from dspark.kernels.spec import KernelSpec

    rows, failed = [], 0
    geometries = {"smollm2": GEOMETRIES["smollm2"]} if quick else GEOMETRIES
    dtypes = ("float32",) if quick else tuple(TOLERANCE)
    windows = (1, 4) if quick else (1, 4, 8, 16)
    for dtype in dtypes:
        for name, dims in geometries.items():
            library = library_for(KernelSpec(dims[0], dims[1], dims[2], 16, dtype))
            for window in windows:
                for splits in (1, 3):
                    seed = zlib.crc32(repr((dtype, name, window, splits)).encode())
                    err = _kernel_case(library, dims, window, splits, device, seed)
                    ok = err <= TOLERANCE[dtype]
                    failed += not ok
                    rows.append({"dtype": dtype, "geometry": name, "window": window,
                                 "splits": splits, "rel_err": err, "ok": ok})
            t = 7
            k_new = torch.randn(t, dims[2], dims[0]).to(getattr(torch, dtype))
            pools = [torch.zeros(8, dims[2], 16, dims[0], dtype=k_new.dtype) for _ in range(4)]
            block, offset = torch.randint(0, 8, (t,)), torch.randperm(16)[:t]
            kv_inject_reference(k_new, -k_new, pools[0], pools[1], block, offset)
            on = [x.to(device) for x in (k_new, -k_new, pools[2], pools[3])]
            kv_inject(*on, block.to(device, torch.int32), offset.to(device, torch.int32),
                      library)
            same = bool(torch.equal(on[2].cpu(), pools[0]) and torch.equal(on[3].cpu(), pools[1]))
            failed += not same
            rows.append({"dtype": dtype, "geometry": name, "kernel": "kv_inject", "ok": same})
    return {"cases": len(rows), "failed": failed, "rows": rows}


def check_cubins(device, cache_dir: str, log: Log) -> dict:
    """Load the prepared cubins for this arch through KernelLibrary and check them."""
    import torch
    import triton

    from dspark.kernels.library import KernelLibrary
    from dspark.kernels.spec import KernelSpec

    index_path = CUBINS / "index.json"
    if not index_path.exists():
        return {"status": "absent", "why": f"no {index_path} (run --prepare before the lease "
                                           "and carry build/gpu-check/cubins)"}
    index = json.loads(index_path.read_text())
    major, minor = torch.cuda.get_device_capability(device)
    arch = f"sm_{major}{minor}"
    out = {"built_with_triton": index["triton"], "here_triton": triton.__version__,
           "arch": arch, "specs": {}}
    for tag, entry in index["specs"].items():
        built = entry["archs"].get(arch)
        if built is None:
            out["specs"][tag] = {"status": "no cubin", "why": f"built for {sorted(entry['archs'])}"}
            continue
        folder = CUBINS / tag
        cubins = {n: (folder / e["cubin"], folder / e["metadata"]) for n, e in built.items()}
        spec = KernelSpec(**entry["spec"])
        try:
            library = KernelLibrary(spec, cache_dir, cubins=cubins)
            dims = (spec.head_dim, spec.num_heads, spec.num_kv_heads)
            errs = [_kernel_case(library, dims, w, s, device, seed=w * 7 + s)
                    for w in (1, 8) for s in (1, 3)]
            ok = max(errs) <= TOLERANCE[spec.dtype]
            out["specs"][tag] = {"status": "loaded", "max_rel_err": max(errs), "ok": ok}
        except Exception as e:  # noqa: BLE001 - the reason is the finding
            why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            if index["triton"] != triton.__version__:
                why += f" (cubins built by Triton {index['triton']}, here {triton.__version__})"
            out["specs"][tag] = {"status": "failed to load: JIT instead", "why": why}
        log(f"  cubins {tag}: {out['specs'][tag]}")
    return out


def prepare() -> None:
    """Compile the cubins for sm_80 and sm_90 here (no GPU needed) for the lease."""
    import_dspark()
    import triton

    from dspark.kernels.aot import compile_cubins
    from dspark.kernels.spec import KernelSpec

    index = {"triton": triton.__version__, "specs": {}}
    src = tempfile.mkdtemp(prefix="dspark-gpu-check-src-")
    for tag, (d, h, kv, dtype) in CUBIN_SPECS.items():
        spec = KernelSpec(d, h, kv, 16, dtype)
        built = compile_cubins(spec, CUBINS / tag, Path(src))
        index["specs"][tag] = {"spec": built["spec"], "archs": built["archs"]}
        print(f"prepared {tag}: {', '.join(built['archs'])}")
    tmp = CUBINS / "index.json.tmp"
    tmp.write_text(json.dumps(index, indent=1))
    tmp.rename(CUBINS / "index.json")


def bench(out: Path, quick: bool) -> dict:
    """bench/bench_kernels.py in this process (its table goes to stdout)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_kernels

    argv = ["bench_kernels", "--json", str(out / "bench_kernels.json")]
    if quick:
        argv += ["--contexts", "4096", "--windows", "8", "--batches", "16", "--iters", "10"]
    saved, sys.argv = sys.argv, argv
    try:
        bench_kernels.main()
    finally:
        sys.argv = saved
    rows = json.loads((out / "bench_kernels.json").read_text())["rows"]
    goal = [r for r in rows if r["geometry"] == "7B-GQA" and r["window"] == 8
            and r["context"] == 4096 and r["batch"] == 16]
    return {"status": "ran", "rows": len(rows),
            "goal_case_of_peak": goal[0]["of_peak"] if goal else None}


def bench_case(library_for) -> dict:
    """Step 4 under the interpreter: one of bench/bench_kernels.py's cases at a tiny size,
    the kernel it would time against the SDPA baseline it is compared with."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_kernels
    import torch

    built = bench_kernels.build_case((16, 4, 2), 2, 37, 3, 16, torch.device("cpu"),
                                     library_for)
    return {"status": "one tiny case (interpreter run)", "max_abs_err": built["max_abs_err"],
            "bytes": built["bytes"]}


def lossless(device, library_for, quick: bool, skew: float = 1.0) -> dict:
    from dspark.runtime.model.device import cuda_problem

    problem = cuda_problem() if device.type == "cuda" else "the CPU interpreter run"
    from gpu_lossless import check, engine_tests

    result = check(device, library_for, windows=(1, 4) if quick else (1, 4, 8),
                   new_tokens=16 if quick else 48, skew=skew)
    result["engine_on_cuda"] = "not run: " + problem if problem else engine_tests(ROOT)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get(
        "OUT", ROOT / "build" / "gpu-check")))
    ap.add_argument("--quick", action="store_true", help="fewer cases (a smoke run)")
    ap.add_argument("--interpret", action="store_true",
                    help="no GPU: steps 3 and 5 under Triton's CPU interpreter, small sizes")
    ap.add_argument("--prepare", action="store_true", help="compile the cubins, then exit")
    ap.add_argument("--wrong-scale", type=float, default=1.0,
                    help="scale q before the lossless check's kernel: a wrong attention on "
                         "purpose, which the check must catch (its test)")
    args = ap.parse_args()
    if args.prepare:
        prepare()
        return 0
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    import_dspark()
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not (torch.cuda.is_available() or args.interpret):
        why = (f"no torch in {sys.executable}, so no CUDA" if torch is None
               else f"no CUDA device (torch {torch.__version__})")
        print(f"gpu-check: {why}; on a GPU it would run: {WOULD_RUN}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out)
    device = torch.device("cpu" if args.interpret else "cuda")
    cache_dir = tempfile.mkdtemp(prefix="dspark-gpu-check-")
    from dspark.kernels.library import KernelLibrary

    def library_for(spec):
        return KernelLibrary(spec, cache_dir, interpret=args.interpret)

    quick = args.quick or args.interpret
    steps = [("environment", lambda: environment(device)),
             ("cubins", None if args.interpret else lambda: check_cubins(device, cache_dir, log)),
             ("kernels", lambda: check_kernels(device, library_for, quick)),
             ("bench", (lambda: bench_case(library_for)) if args.interpret
              else lambda: bench(args.out, args.quick)),
             ("lossless", lambda: lossless(device, library_for, quick, args.wrong_scale))]
    if args.wrong_scale != 1.0:  # only the check that must fail
        steps = [(name, step if name == "lossless" else None) for name, step in steps]
    summary: dict = {name: {"status": "skipped"} for name, step in steps if step is None}
    for name, step in ((n, s) for n, s in steps if s is not None):
        t0 = time.perf_counter()
        try:
            summary[name] = step()
        except Exception as e:  # noqa: BLE001 - one failed step must not lose the others
            summary[name] = {"status": "error", "why": f"{type(e).__name__}: {e}"}
            log(traceback.format_exc())
        summary[name]["seconds"] = round(time.perf_counter() - t0, 1)
        log(f"{name:12} {_short(summary[name])}")
    tmp = args.out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1, default=str))
    tmp.rename(args.out / "summary.json")
    bad = summary["kernels"].get("failed", 1) or not summary["lossless"].get("passed")
    log(f"gpu-check: {'FAILED' if bad else 'passed'}; summary in {args.out / 'summary.json'}")
    return 1 if bad else 0


def _short(result: dict) -> str:
    keys = ("status", "name", "arch", "triton", "cases", "failed", "passed",
            "goal_case_of_peak", "engine_on_cuda", "why", "seconds")
    return ", ".join(f"{k}={result[k]}" for k in keys if k in result)


if __name__ == "__main__":
    sys.exit(main())
