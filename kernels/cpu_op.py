"""The CPU SpeculativeVerify op for onnxruntime (cpu_op.c), built on first use.

With it a CPU model runs as one onnxruntime session with the attention inside
(runtime/model/fused.py) instead of ~31 sessions with Python attention between them, and
decode steps and verifies run faster by the Python they no longer wait for.

The library is compiled for this machine (-march=native) by the C compiler in CC (default
cc) into the kernel cache, named by a hash of the source, flags, compiler and CPU, so a
cache shared by different machines holds one file per CPU kind. Written to a temporary name
and renamed: processes that build at once each get a whole file. No compiler, or a failed
build: `OpLibrary.path` is None with the reason, and the runtime uses its segments.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("dspark.kernels")

HERE = Path(__file__).resolve().parent
# the library: SpeculativeVerify (cpu_op.c, which registers every op), MatMulInt4 (its
# plain loops and op, its x86 and aarch64 vector paths), the row ops (RmsNorm, SkipRmsNorm,
# Silu: cpu_rows.c) and QuantizeTokens (cpu_quant.c)
SOURCES = (HERE / "cpu_op.c", HERE / "cpu_int4.c", HERE / "cpu_int4_x86.c",
           HERE / "cpu_int4_arm.c", HERE / "cpu_rows.c", HERE / "cpu_quant.c",
           HERE / "cpu_kv.c")
HEADERS = (HERE / "ort_abi.h", HERE / "cpu_int4.h", HERE / "cpu_int4_body.h",
           HERE / "cpu_kv.h")
# MatMulInt4 picks its path at run time, each compiled for its own instruction set: on
# x86-64 its files take a baseline every such CPU has instead of -march=native, so its
# AVX2 path is AVX2 code on this CPU too (its tests run every path the CPU has)
ISA_PATHS = ("generic", "avx2", "avx_vnni", "avx512", "avx512_vnni",
             "neon_dotprod")  # cpu_int4.h, in order
PORTABLE = {"cpu_int4.c", "cpu_int4_x86.c", "cpu_int4_arm.c"}
X86_PATHS = 4  # cpu_int4_x86.c's paths, each compiled on its own (DSPARK_X86_PATH)
BASELINE = ("-march=x86-64-v2", "-mtune=native")
# files whose arithmetic must be IEEE's as written (QuantizeTokens: a division, not a product
# with the reciprocal; onnxruntime's rounding, bit for bit; the KV cache's float16 and int8
# rows, as the reference rounds them): no fast-math flags, and the KV rows no contraction
EXACT = {"cpu_quant.c", "cpu_kv.c"}
UNCONTRACTED = {"cpu_kv.c"}
_FAST = {"-ffast-math", "-fassociative-math", "-freciprocal-math", "-fno-signed-zeros"}
# Two builds, the first that links wins:
#   compiled with -ffast-math, linked without it, with glibc's vector math library: the dot
#   products vectorise and so does expf (libmvec), a quarter faster a layer than the plain
#   build. Linking with -ffast-math would add crtfastmath.o, whose
#   constructor turns on flush-to-zero for the whole process when the library loads
#   (hypothesis caught numpy's subnormals vanishing): the link step leaves it out.
#   one step without -ffast-math (reassociation only: vector dot products, scalar expf),
#   where there is no libmvec.
BUILDS = (
    (("-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c11", "-c"),
     ("-shared",), ("-lmvec", "-lm")),
    (("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
      "-fassociative-math", "-freciprocal-math", "-fPIC", "-std=c11", "-c"),
     ("-shared",), ("-lm",)),
)


@dataclass(frozen=True)
class OpLibrary:
    path: Path | None  # the shared library, or None when it could not be built
    reason: str  # how it was obtained, or why there is none


def _cpu_signature() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))]
    return platform.machine() + "\n" + "\n".join(sorted(set(keep)))


def _compiler_version(cc: str) -> str | None:
    try:
        done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


@functools.cache
def op_library(cache_dir: str, cc: str, march: str = "native") -> OpLibrary:
    """The op library for this machine: cached, else built now (about a second). `march`:
    what the attention is compiled for (DSPARK_CPU_MARCH; native: this CPU)."""
    version = _compiler_version(cc)
    if version is None:
        return OpLibrary(None, f"no C compiler ({cc!r}; set CC)")
    source = b"\0".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    flags = repr((BUILDS, sorted(EXACT), sorted(UNCONTRACTED), sorted(PORTABLE),
                  BASELINE)).encode()
    key = hashlib.sha256(b"\0".join([source, flags, version.encode(),
                                     _cpu_signature().encode(), march.encode()])).hexdigest()[:16]
    target = Path(cache_dir) / f"dspark-cpu-op-{key}.so"
    if target.exists():
        return OpLibrary(target, f"cached {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for compile_flags, link_flags, libs in BUILDS:
        flags = tuple(f"-march={march}" if f == "-march=native" else f for f in compile_flags)
        error = _build(cc, flags, link_flags, libs, target)
        if error is None:
            log.info("built the CPU SpeculativeVerify op: %s", target)
            return OpLibrary(target, f"built {target}")
        errors.append(error)
    return OpLibrary(None, f"{cc} failed: {errors[-1]}")


def _build(cc: str, compile_flags: tuple[str, ...], link_flags: tuple[str, ...],
           libs: tuple[str, ...], target: Path) -> str | None:
    """Compile SOURCES side by side, one compiler per core, and link them to `target`
    (through temporary names); the error, if any."""
    from concurrent.futures import ThreadPoolExecutor

    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        units = [(source, define, Path(tmp) / f"{source.stem}{define and '-' + define[-1]}.o")
                 for source in SOURCES for define in compile_units(source)]
        lib = Path(tmp) / target.name
        steps = [[cc, *_flags(compile_flags, source), *([define] if define else []),
                  "-o", str(obj), str(source)] for source, define, obj in units]
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            errors = [e for e in pool.map(_run, steps) if e is not None]
        if errors:
            return errors[0]
        error = _run([cc, *link_flags, "-o", str(lib), *(str(o) for *_, o in units), *libs])
        if error is not None:
            return error
        os.replace(lib, target)
    return None


def compile_units(source: Path, machine: str | None = None) -> tuple[str, ...]:
    """The compiler's runs of `source` for `machine` (default: this one), a define each: the
    x86 paths one object each (a third of the file's time apiece, so they build side by
    side), every other file whole ("")."""
    if source.name != "cpu_int4_x86.c" or (machine or platform.machine()) not in (
            "x86_64", "AMD64"):
        return ("",)
    return tuple(f"-DDSPARK_X86_PATH={n}" for n in range(X86_PATHS))


def _run(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return done.stderr.strip()[-500:] if done.returncode != 0 else None


def _flags(compile_flags: tuple[str, ...], source: Path) -> list[str]:
    if source.name in EXACT:
        return ([f for f in compile_flags if f not in _FAST] + ["-fno-fast-math"]
                + (["-ffp-contract=off"] if source.name in UNCONTRACTED else []))
    if source.name not in PORTABLE or platform.machine() not in ("x86_64", "AMD64"):
        return list(compile_flags)
    return [f for f in compile_flags if not f.startswith("-march=")] + list(BASELINE)


@functools.cache
def int4_paths(library: Path) -> tuple[str, ...]:
    """The MatMulInt4 paths this CPU runs, best last ("generic": the plain loops, slower
    than onnxruntime's MatMulNBits; the others are vector paths, cpu_int4_x86.c and
    cpu_int4_arm.c)."""
    import ctypes

    try:
        mask = int(ctypes.CDLL(str(library)).dspark_int4_paths())
    except (OSError, AttributeError):
        return ()
    return tuple(name for i, name in enumerate(ISA_PATHS) if mask & (1 << i))


def int4_timings(library: Path, isas: tuple[str, ...], packed, k: int, n: int, bits: int,
                 mins: bool, rounds: int = 3) -> dict[str, float]:
    """Median seconds of one row through each of `isas` on these packed weights (one thread,
    dspark_int4_run), the paths taking turns, every call after 64 MB written, so that the
    weights come from memory as in a decode step."""
    import ctypes
    import statistics
    import time

    import numpy as np

    run = ctypes.CDLL(str(library)).dspark_int4_run
    run.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                    *[ctypes.c_int64] * 5]
    x = np.random.default_rng(0).standard_normal((1, k)).astype(np.float32)
    y = np.empty((1, n), np.float32)
    flush = np.zeros(64 << 20, np.uint8)
    times: dict[str, list[float]] = {isa: [] for isa in isas}
    for _ in range(rounds):
        for isa in isas:
            flush += 1
            t0 = time.perf_counter()
            run(ISA_PATHS.index(isa), x.ctypes.data, packed.ctypes.data, y.ctypes.data, 1, k, n,
                bits, int(mins))
            times[isa].append(time.perf_counter() - t0)
    return {isa: statistics.median(t) for isa, t in times.items()}


class SoloOps:
    """The library's process-wide switch (dspark_set_solo, cpu_op.c): on, our ops run their
    work items in turn on the calling thread instead of on onnxruntime's pool. Set only when it
    changes; main and draft share it, as they share the pool."""

    def __init__(self, library: Path):
        import ctypes

        self._set = ctypes.CDLL(str(library)).dspark_set_solo
        self._set.argtypes = [ctypes.c_int]
        self.on = False
        self._set(0)

    def set(self, on: bool) -> None:
        if on != self.on:
            self._set(int(on))
            self.on = on


@functools.cache
def solo_ops(library: Path) -> SoloOps:
    """The switch of `library` (the one onnxruntime loaded: the same file is loaded once)."""
    return SoloOps(library)
