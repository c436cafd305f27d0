"""MatMulInt4's paths across architectures (tests/int4_harness.c): the same random cases on
every path, natively and, where a cross compiler and qemu-user are installed (Debian:
gcc-aarch64-linux-gnu, qemu-user; .ci/run installs them), on aarch64's NEON dot-product
path under emulation. Every path of both must give the same bits."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from dspark.runtime.env import read_env

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "kernels"
SOURCES = [ROOT / "tests" / "int4_harness.c"] + [
    KERNELS / name for name in ("cpu_int4.c", "cpu_int4_x86.c", "cpu_int4_arm.c")]
CROSS, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
SYSROOT = Path("/usr/aarch64-linux-gnu")


def _build(cc: str, out: Path, flags: list[str]) -> Path:
    done = subprocess.run([cc, "-O2", "-std=c11", f"-I{KERNELS}", *flags, "-o", str(out),
                           *map(str, SOURCES), "-lm"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def _hashes(command: list[str]) -> dict[tuple[str, str], str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    return {(case, path): digest for case, path, digest in lines}


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    flags = ["-march=x86-64-v2"] if platform.machine() in ("x86_64", "AMD64") else []
    binary = _build(read_env().cc, tmp_path_factory.mktemp("native") / "harness", flags)
    return _hashes([str(binary)])


def test_every_native_path_gives_the_same_bits(native):
    cases = {case for case, _ in native}
    assert len(cases) == 28  # 7 shapes x 4 formats
    for case in cases:
        digests = {path: d for (c, path), d in native.items() if c == case}
        assert "generic" in digests and len(set(digests.values())) == 1, (case, digests)


@pytest.mark.skipif(not (shutil.which(CROSS) and shutil.which(QEMU) and SYSROOT.exists()),
                    reason=f"needs {CROSS} and {QEMU} (Debian: gcc-aarch64-linux-gnu qemu-user)")
def test_the_aarch64_dot_product_path_gives_the_native_bits(native, tmp_path):
    binary = _build(CROSS, tmp_path / "harness-aarch64", [])
    arm = _hashes([QEMU, "-L", str(SYSROOT), str(binary)])
    assert {path for _, path in arm} == {"generic", "neon_dotprod"}  # qemu's CPU has sdot
    want = {case: d for (case, path), d in native.items() if path == "generic"}
    for (case, path), digest in arm.items():
        assert digest == want[case], (case, path)
