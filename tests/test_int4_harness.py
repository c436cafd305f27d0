"""MatMulInt4's paths across architectures (tests/int4_harness.c): the same random cases on
every path, natively and, where a cross compiler and qemu-user are installed (Debian:
gcc-aarch64-linux-gnu, qemu-user; .ci/run installs them), on aarch64's NEON dot-product
path under emulation. Every path of both must give the same bits. qemu-user does not run
AVX-VNNI (nor AVX-512); on a CPU with AVX-512 VNNI the AVX-VNNI path's code runs in a
stand-in build instead (the EVEX form of the same instruction, 16 registers)."""

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


def _build(cc: str, out: Path, flags: list[str], machine: str | None = None) -> Path:
    """The harness for `machine` (default: this one), its objects compiled side by side as
    the op library's are (cpu_op.compile_units), then linked."""
    from concurrent.futures import ThreadPoolExecutor

    from dspark.kernels.cpu_op import compile_units

    units = [(source, define, out.with_name(f"{out.name}-{source.stem}{define[-1:]}.o"))
             for source in SOURCES for define in compile_units(source, machine)]

    def run(cmd: list[str]) -> None:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]

    with ThreadPoolExecutor() as pool:
        list(pool.map(run, [[cc, "-O2", "-std=c11", f"-I{KERNELS}", *flags,
                             *([define] if define else []), "-c", "-o", str(obj), str(source)]
                            for source, define, obj in units]))
    run([cc, "-o", str(out), *(str(obj) for *_, obj in units), "-lm"])
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


def test_the_avx_vnni_path_gives_the_same_bits_in_its_stand_in(native, tmp_path):
    """AVX-VNNI (Intel's client CPUs from Alder Lake on) is a path of its own that most CPUs
    cannot run. Built with DSPARK_AVX_VNNI_AS_EVEX, its code takes the EVEX `vpdpbusd` of
    AVX-512 VNNI, with xmm16-31 kept from the compiler (its register budget), and must give
    the plain loops' bits."""
    if "avx_vnni" in {path for _, path in native}:
        pytest.skip("this CPU runs AVX-VNNI itself (test_every_native_path_gives_the_same_bits)")
    if "avx512_vnni" not in {path for _, path in native}:
        pytest.skip("the stand-in needs AVX-512 VNNI")
    fixed = [f"-ffixed-xmm{i}" for i in range(16, 32)]
    binary = _build(read_env().cc, tmp_path / "harness-avx-vnni",
                    ["-march=x86-64-v2", "-DDSPARK_AVX_VNNI_AS_EVEX", *fixed])
    stand_in = _hashes([str(binary)])
    want = {case: d for (case, path), d in native.items() if path == "generic"}
    got = {case: d for (case, path), d in stand_in.items() if path == "avx_vnni"}
    assert set(got) == set(want)
    assert got == want


@pytest.mark.skipif(not (shutil.which(CROSS) and shutil.which(QEMU) and SYSROOT.exists()),
                    reason=f"needs {CROSS} and {QEMU} (Debian: gcc-aarch64-linux-gnu qemu-user)")
def test_the_aarch64_dot_product_path_gives_the_native_bits(native, tmp_path):
    binary = _build(CROSS, tmp_path / "harness-aarch64", [], machine="aarch64")
    arm = _hashes([QEMU, "-L", str(SYSROOT), str(binary)])
    assert {path for _, path in arm} == {"generic", "neon_dotprod"}  # qemu's CPU has sdot
    want = {case: d for (case, path), d in native.items() if path == "generic"}
    for (case, path), digest in arm.items():
        assert digest == want[case], (case, path)
