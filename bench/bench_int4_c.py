"""MatMulInt4's x86 paths without onnxruntime, one thread: this tree's kernels against
another revision's, per projection shape and row count, interleaved in one process.

    python bench/bench_int4_c.py --isa avx2 [--against REV] [--rows 1,2,5,9]
                                   [--repeats 300] [--shapes smollm2|gemma3] [--mins]
                                   [--stand-in]

Both sides' kernels/cpu_int4_x86.c are built as the op library builds them (-O3, the x86-64-v2
baseline, each path its own target) and linked into bench/int4_timing.c, which times the
best of --repeats calls per side, the weights from memory. --stand-in builds the AVX-VNNI
path as its stand-in on a CPU with AVX-512 VNNI (DSPARK_AVX_VNNI_AS_EVEX: the EVEX form of
the same instruction, xmm16-31 kept from the compiler; on a revision from before that
switch, the same substitution in its text). Prints the CPU line, then per shape and row count
old and new microseconds, new/old, and whether both gave the same bits. --mins: the weights
carry a min per block (GGUF's Q4_1), else a zero point (dsc quantize's, genai's).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_int4 import SHAPES

from dspark.kernels.cpu_op import ISA_PATHS
from dspark.runtime.env import read_env
from dspark.runtime.model.device import cpu_line

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("cpu_int4_x86.c", "cpu_int4_body.h", "cpu_int4.h")
FLAGS = ["-O3", "-march=x86-64-v2", "-mtune=native", "-ffast-math", "-std=c11"]
STAND_IN = ["-DDSPARK_AVX_VNNI_AS_EVEX", *(f"-ffixed-xmm{i}" for i in range(16, 32))]


def _old_sources(rev: str, folder: Path, stand_in: bool) -> Path:
    """REV's kernel sources under `folder`; for --stand-in on a revision without the switch,
    its AVX-VNNI path rewritten to the stand-in's instruction and CPU check."""
    for name in KERNELS:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kernels/{name}"],
                              capture_output=True, text=True, check=True).stdout
        if stand_in and name == "cpu_int4_x86.c" and "DSPARK_AVX_VNNI_AS_EVEX" not in text:
            text = (text.replace("_mm256_dpbusd_avx_epi32", "_mm256_dpbusd_epi32")
                    .replace('"avx2,avxvnni,f16c,fma"', '"avx2,avx512vl,avx512vnni,f16c,fma"')
                    .replace('__builtin_cpu_supports("avxvnni")',
                             '__builtin_cpu_supports("avx512vnni")'))
        (folder / name).write_text(text)
    return folder


def build(rev: str, stand_in: bool, folder: Path) -> Path:
    """The timing binary: this tree's kernels as `int4_groups_x86`, REV's as `old_`."""
    cc, extra = read_env().cc, STAND_IN if stand_in else []
    old = _old_sources(rev, folder, stand_in)
    steps = [
        [cc, *FLAGS, *extra, f"-I{old}", "-Dint4_groups_x86=old_groups_x86",
         "-Dint4_x86_supported=old_x86_supported", "-c", str(old / "cpu_int4_x86.c"),
         "-o", str(folder / "old.o")],
        [cc, *FLAGS, *extra, f"-I{ROOT / 'kernels'}", "-c",
         str(ROOT / "kernels" / "cpu_int4_x86.c"), "-o", str(folder / "new.o")],
        [cc, "-O2", "-std=c11", f"-I{ROOT / 'kernels'}", str(ROOT / "bench" / "int4_timing.c"),
         str(folder / "new.o"), str(folder / "old.o"), "-o", str(folder / "timing")],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"bench_int4_c: building failed: {done.stderr[-2000:]}")
    return folder / "timing"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isa", choices=[p for p in ISA_PATHS if p.startswith("avx")],
                    required=True)
    ap.add_argument("--against", default="HEAD", help="the revision to compare (default HEAD)")
    ap.add_argument("--rows", default="1,2,4,5,9,12")
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--mins", action="store_true", help="blocks with mins (Q4_1)")
    ap.add_argument("--stand-in", action="store_true",
                    help="the AVX-VNNI path as its AVX-512 VNNI stand-in (with --isa avx_vnni)")
    args = ap.parse_args()
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows: {args.rows!r} is not a comma-separated list of integers")
    if args.stand_in and args.isa != "avx_vnni":
        ap.error("--stand-in: only for --isa avx_vnni")
    print(cpu_line())
    print(f"path {args.isa}{' (stand-in)' if args.stand_in else ''}, one thread, "
          f"{'mins' if args.mins else 'zero points'}, "
          f"this tree against {args.against}")
    print(f"{'shape':<10} {'rows':>4} {'old us':>9} {'new us':>9} {'new/old':>8}  bits")
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(args.against, args.stand_in, Path(tmp))
        for name, k, n, bits in SHAPES[args.shapes]:
            done = subprocess.run(
                [str(binary), str(ISA_PATHS.index(args.isa)), str(k), str(n), str(bits),
                 str(int(args.mins)),
                 str(args.repeats), *map(str, rows)], capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"bench_int4_c: {name}: exit {done.returncode} (does this CPU run "
                         f"{args.isa}{' in its stand-in' if args.stand_in else ''}?)")
            for line in done.stdout.split("\n"):
                if line:
                    r, old, new, same = line.split()
                    print(f"{name:<10} {r:>4} {float(old):9.1f} {float(new):9.1f} "
                          f"{float(new) / float(old):8.3f}  {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
