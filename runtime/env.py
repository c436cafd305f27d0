"""The one module that reads the process environment.

Every other module receives these values as arguments; nothing else calls os.environ.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import tempfile
from dataclasses import dataclass

from dspark.runtime.errors import DSparkError

FREE_CORES_SPAN = 0.5  # seconds DSPARK_THREADS=auto watches the other processes' load


@dataclass(frozen=True)
class RuntimeEnv:
    threads: int  # intra-op threads for the shared onnxruntime pool
    cache_dir: str  # where samples and fixtures cache build outputs
    debug: bool  # show tracebacks of internal errors
    api_key: str | None  # DSPARK_API_KEY: the server's bearer token when --api-key is not given
    cpu_op: bool  # DSPARK_CPU_OP=0: run CPU models as segments, not one session with our op
    cpu_int4: bool  # DSPARK_CPU_INT4=0: keep the models' MatMulNBits (no MatMulInt4)
    cc: str  # CC: the C compiler that builds the CPU op
    # DSPARK_CPU_ISA: MatMulInt4's path (generic, avx2, avx_vnni, avx512, avx512_vnni,
    # neon_dotprod); None: the best the CPU runs
    cpu_isa: str | None = None
    # DSPARK_CPU_MARCH: the -march the CPU op's attention is compiled for (native: this CPU;
    # e.g. haswell runs the AVX2 build on an AVX-512 machine)
    cpu_march: str = "native"
    # DSPARK_CPU_ROWS=0: keep onnxruntime's norms and SiLU (no RmsNorm, Silu: row_ops.py)
    cpu_rows: bool = True
    # DSPARK_THREADS=adaptive: the pool at every core, plus a one-thread session per CPU model
    # that forwards take while other processes hold cores (runtime/model/load_gate.py)
    adaptive: bool = False
    # unset, auto or adaptive: while other processes hold the cores the pool counts on, our
    # ops run on the calling thread (load_gate.py); DSPARK_THREADS=N keeps N threads always
    follow_load: bool = False
    # DSPARK_HASH=full: hash every bundle file at every load (default: files unchanged since
    # this machine last hashed them are not read again, bundle/file_check.py)
    full_hash: bool = False

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise DSparkError(f"DSPARK_THREADS must be >= 1, got {self.threads}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", self.cpu_march):
            raise DSparkError(f"DSPARK_CPU_MARCH must be a -march name, e.g. haswell, got "
                              f"{self.cpu_march!r}")


def child_env(drop: tuple[str, ...]) -> dict[str, str]:
    """This process's environment without `drop`, for a child that must not inherit them."""
    return {k: v for k, v in os.environ.items() if k not in drop}


def read_env() -> RuntimeEnv:
    raw = os.environ.get("DSPARK_THREADS", "")
    try:
        threads = (int(raw) if raw and raw not in ("auto", "adaptive") else
                   _free_cores() if raw == "auto" else (os.cpu_count() or 1))
    except ValueError:
        raise DSparkError(f"DSPARK_THREADS must be an integer, auto or adaptive, got {raw!r}"
                          ) from None
    cache_dir = os.environ.get("DSPARK_CACHE", os.path.join(os.getcwd(), "build"))
    debug = os.environ.get("DSPARK_DEBUG", "") not in ("", "0")
    return RuntimeEnv(threads=threads, cache_dir=cache_dir, debug=debug,
                      api_key=os.environ.get("DSPARK_API_KEY") or None,
                      cpu_op=os.environ.get("DSPARK_CPU_OP", "1") != "0",
                      cpu_int4=os.environ.get("DSPARK_CPU_INT4", "1") != "0",
                      cpu_rows=os.environ.get("DSPARK_CPU_ROWS", "1") != "0",
                      cc=os.environ.get("CC") or "cc",
                      cpu_isa=os.environ.get("DSPARK_CPU_ISA") or None,
                      cpu_march=os.environ.get("DSPARK_CPU_MARCH") or "native",
                      adaptive=raw == "adaptive" and threads > 1,
                      follow_load=raw in ("", "auto", "adaptive") and threads > 1,
                      full_hash=os.environ.get("DSPARK_HASH", "") == "full")


@functools.cache
def _free_cores() -> int:
    """DSPARK_THREADS=auto: the cores other processes leave free, measured once per process
    over FREE_CORES_SPAN seconds (host_load.py; all cores where /proc cannot say)."""
    import time

    from dspark.runtime.host_load import HostLoad, free_cores

    load = HostLoad()
    load.sample()
    time.sleep(FREE_CORES_SPAN)
    return free_cores(load.sample(), os.cpu_count() or 1)


def kernel_cache_dir() -> str:
    """Where rendered kernel sources are written for Triton to import (content-named files,
    safe to share between processes): DSPARK_KERNEL_CACHE, else a per-user temp folder."""
    default = os.path.join(tempfile.gettempdir(), f"dspark-kernels-{os.getuid()}")
    return os.environ.get("DSPARK_KERNEL_CACHE", default)


# glibc malloc tunables dsrun runs with (those the user set are kept as they are)
MALLOC_TUNABLES = ("glibc.malloc.hugetlb=1", "glibc.malloc.arena_max=2")


def hugepage_env() -> dict[str, str] | None:
    """The environment to re-run this process in with MALLOC_TUNABLES; None if they are all
    set already, on opting out (DSPARK_HUGEPAGES=0) or off Linux.

    glibc reads GLIBC_TUNABLES only at start-up, hence a re-run. hugetlb=1: onnxruntime's
    weight buffers get transparent huge pages and stream with far fewer TLB misses (decode
    steps run faster, and two models in one process stop differing with load order).
    arena_max=2: the server's threads (event loop, engine, tokenizer workers) share two
    malloc arenas instead of one each, and a long soak's RSS levels off instead of rising.
    The figures: docs/experiments.md, "Figures behind the source's choices"."""
    if sys.platform != "linux" or os.environ.get("DSPARK_HUGEPAGES", "1") == "0":
        return None
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    missing = [t for t in MALLOC_TUNABLES if t.split("=")[0] not in tunables]
    if not missing:
        return None
    return {**os.environ, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, *missing]))}


# Ray Serve's control plane wakes every 100 ms by default (the controller's loop, every
# actor's metrics export). On a small machine each wake-up steals a core from an engine's
# intra-op threads, which wait for each other: with a 2-core replica on 2 cores, these
# slower rates sped a plain completion up by about 5%. dsrun cluster starts
# its local Ray with them (values the user set are kept; a joined cluster keeps its own).
RAY_SERVE_QUIET = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
                   "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}


def quiet_ray_serve() -> None:
    """Set RAY_SERVE_QUIET in this process's environment (a local Ray inherits it)."""
    for key, value in RAY_SERVE_QUIET.items():
        os.environ.setdefault(key, value)
