"""The CPU attention's builds without onnxruntime (tests/attention_harness.c): this machine's
own build, the 8-lane build an AVX2 CPU gets (where this one has AVX-512), and aarch64's
under qemu-user (Debian: gcc-aarch64-linux-gnu, qemu-user; .ci/run installs them). Each must
give a verify window's queries the same bits as their decode steps and as any split of the
window, and agree with the plain loops to rounding: what speculation's losslessness rests
on, on CPUs the test machine cannot load the library for."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from cpu_builds import cpu_flags, marches

from dspark.runtime.env import read_env

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "attention_harness.c"
CROSS, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
SYSROOT = Path("/usr/aarch64-linux-gnu")
FLAGS = ["-O3", "-ffast-math", "-std=c11"]  # the op library's first build (kernels/cpu_op.py)
CASES = 5


def _build(cc: str, out: Path, flags: list[str], libs: list[str]) -> Path:
    done = subprocess.run([cc, *FLAGS, *flags, f"-I{ROOT / 'kernels'}", "-o", str(out),
                           str(HARNESS), *libs], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def _run(command: list[str], path: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    lines = done.stdout.splitlines()
    assert lines and lines[0] == f"path {path}", done.stdout
    assert len(lines) == 1 + CASES and all(line.split()[1] == "ok" for line in lines[1:]), (
        done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr


def _native_builds() -> list[tuple[str, str]]:
    """(march, path): haswell is what an AVX2 CPU's -march=native gives."""
    wide = "avx512f" in cpu_flags()
    return [(m, "16-lane" if m == "native" and wide else "8-lane") for m in marches()]


@pytest.mark.parametrize(("march", "path"), _native_builds())
def test_this_machines_builds_keep_a_window_equal_to_its_steps(march, path, tmp_path):
    binary = _build(read_env().cc, tmp_path / f"attention-{march}", [f"-march={march}"],
                    ["-lm"])
    _run([str(binary)], path)


@pytest.mark.skipif(not (shutil.which(CROSS) and shutil.which(QEMU) and SYSROOT.exists()),
                    reason=f"needs {CROSS} and {QEMU} (Debian: gcc-aarch64-linux-gnu qemu-user)")
def test_the_aarch64_build_keeps_a_window_equal_to_its_steps(tmp_path):
    binary = _build(CROSS, tmp_path / "attention-aarch64", [], ["-lm"])
    _run([QEMU, "-L", str(SYSROOT), str(binary)], "8-lane")
