"""Which builds of the CPU op's attention this machine runs (the tests of each build)."""

from __future__ import annotations


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return set()


def marches() -> list[str]:
    """The builds of the attention this machine runs: its own, and on an x86 CPU with AVX-512
    also the AVX2 one (8 lanes, what a CPU without AVX-512 compiles)."""
    return ["native"] + (["haswell"] if {"avx512f", "avx2", "fma"} <= cpu_flags() else [])


def library_for(march: str):
    """The op library built for `march` (the test machines have a C compiler)."""
    from dspark.kernels.cpu_op import op_library
    from dspark.runtime.env import kernel_cache_dir, read_env

    built = op_library(kernel_cache_dir(), read_env().cc, march)
    assert built.path is not None, built.reason
    return built.path
