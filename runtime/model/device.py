"""Which device the runtime runs on: `--device auto|cpu|cuda`.

auto picks CUDA when torch sees a GPU and onnxruntime has its CUDA execution provider
(the `gpu` extra, onnxruntime-gpu), else the CPU. Asking for cuda where either is missing is
a usage error that says which part is missing. torch is imported where a device is made, not
with this module: dsrun's command line names DEVICES before it re-runs itself with glibc's
tunables (cli/util.py), and importing torch twice cost every command ~2.4 s.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import TYPE_CHECKING

from dspark.runtime.errors import DSparkError

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cpu", "cuda")
# the instruction sets a CPU benchmark depends on (MatMulInt4's paths, the compiled ops)
ISA_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni",
             "asimd", "asimddp")


def cpu_line() -> str:
    """'CPU <model>, <cores> cores, flags <the ISA_FLAGS it has>': how every benchmark report
    starts (users' CPUs differ; a path this one lacks is unmeasured), then the paths the
    environment forces (DSPARK_CPU_ISA, DSPARK_CPU_MARCH), which a report measured instead of
    the CPU's best."""
    import os

    from dspark.runtime.env import read_env

    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                  if ln.startswith(("model name", "Model"))), platform.processor() or "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                      if ln.startswith(("flags", "Features"))), []))
    have = [f for f in ISA_FLAGS if f in flags]
    env = read_env()
    forced = f"; dsrun's MatMulInt4 forced to its {env.cpu_isa} path" if env.cpu_isa else ""
    if env.cpu_march != "native":
        forced += f"; its attention built for -march={env.cpu_march}"
    return (f"CPU {model} ({platform.machine()}), {os.cpu_count()} cores, flags "
            f"{' '.join(have) or 'none of ' + ' '.join(ISA_FLAGS)}{forced}")


def cuda_problem() -> str | None:
    """Why CUDA cannot be used here, or None when it can."""
    import torch

    if not torch.cuda.is_available():
        build = torch.version.cuda or "none (a CPU build)"
        return f"torch {torch.__version__} sees no CUDA device (its CUDA: {build})"
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return ("onnxruntime has no CUDAExecutionProvider (install the gpu extra: "
                "pip install 'dspark[gpu]', which brings onnxruntime-gpu)")
    return None


def resolve_device(name: str) -> torch.device:
    import torch

    if name not in DEVICES:
        raise DSparkError(f"--device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "cpu":
        return torch.device("cpu")
    problem = cuda_problem()
    if problem is None:
        return torch.device("cuda", torch.cuda.current_device())
    if name == "cuda":
        raise DSparkError(f"--device cuda: {problem}")
    return torch.device("cpu")
