"""Ahead-of-time compilation of the rendered kernels to cubin with Triton's own compiler
(`triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))` needs no GPU).

Run as a module in a child process (`python -m dspark.kernels.aot SPEC_JSON OUT ARCHS`) so
that the caller's Triton mode (e.g. the interpreter in tests) cannot leak into it and a
broken toolchain cannot take the caller down. For each arch it writes, per kernel, the cubin
and Triton's metadata JSON (what triton.compiler.CompiledKernel loads), and prints an index.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from dspark.kernels.spec import TRITON_PTR, KernelSpec

ARCHS = (80, 90)
# The kernel registry. name -> (template, kernel, argument types in order, constexpr values,
# warps); pointers of the model's dtype are "*T". Each name is one cubin per arch, and what
# KernelLibrary.launch takes.
_VERIFY_ARGS = [
    ("Q", "*T"), ("K", "*T"), ("V", "*T"), ("O", "*T"), ("PartO", "*fp32"),
    ("PartLse", "*fp32"), ("BlockTables", "*i32"), ("SeqStart", "*i32"), ("SeqNew", "*i32"),
    ("SeqQOff", "*i32"), ("scale", "fp32"), ("window", "i32"), ("softcap", "fp32"),
    ("stride_bt", "i32"),
    ("num_splits", "i32"), ("blocks_per_split", "i32"), ("UPCAST", "constexpr"),
    ("SPLIT", "constexpr")]
KERNELS = {
    "verify_attention": ("verify_attention", "_verify_attention_kernel", _VERIFY_ARGS,
                         {"UPCAST": False, "SPLIT": False}, 4),
    "verify_attention_split": ("verify_attention", "_verify_attention_kernel", _VERIFY_ARGS,
                               {"UPCAST": False, "SPLIT": True}, 4),
    "verify_reduce": ("verify_attention", "_verify_reduce_kernel", [
        ("PartO", "*fp32"), ("PartLse", "*fp32"), ("O", "*T"), ("num_splits", "i32")], {}, 1),
    "kv_inject": ("kv_cache", "_kv_inject_kernel", [
        ("KNew", "*T"), ("VNew", "*T"), ("K", "*T"), ("V", "*T"), ("TokBlock", "*i32"),
        ("TokOffset", "*i32")], {}, 1),
    "kv_zero": ("kv_cache", "_kv_zero_kernel", [
        ("K", "*T"), ("V", "*T"), ("SlotBlock", "*i32"), ("SlotOffset", "*i32")], {}, 1),
}


# Pointers are declared 16-byte aligned, as Triton's JIT would find them, so that loads
# vectorise; the runtime only launches a cubin on aligned tensors (KernelLibrary.launch).
ALIGN = 16


def ast_source(fn, spec: KernelSpec, args: list[tuple[str, str]], values: dict):
    """What triton.compile needs for one registered kernel; the runtime rebuilds the same to
    get Triton's launcher for a loaded cubin."""
    from triton.compiler import ASTSource

    signature = {a: TRITON_PTR[spec.dtype] if t == "*T" else t for a, t in args}
    constexprs = {(i,): values[a] for i, (a, t) in enumerate(args) if t == "constexpr"}
    attrs = {(i,): [["tt.divisibility", ALIGN]] for i, (_, t) in enumerate(args)
             if t.startswith("*")}
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


class ToolchainError(RuntimeError):
    """Triton could not compile for CUDA here (no backend, no ptxas...)."""


def _compile(spec: KernelSpec, out: Path, archs: tuple[int, ...], src: Path) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    from dspark.kernels.render import load

    index: dict = {"triton": triton.__version__, "spec": asdict(spec), "archs": {}}
    for arch in archs:
        folder = out / f"sm_{arch}"
        folder.mkdir(parents=True, exist_ok=True)
        entries = index["archs"][f"sm_{arch}"] = {}
        for name, (template, kernel, args, values, warps) in KERNELS.items():
            fn = getattr(load(template, spec, str(src)), kernel)
            compiled = triton.compile(ast_source(fn, spec, args, values),
                                      target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": warps})
            cubin = compiled.asm["cubin"]
            (folder / f"{name}.cubin").write_bytes(cubin)
            meta = json.dumps(compiled.metadata._asdict(), default=vars, sort_keys=True)
            (folder / f"{name}.json").write_text(meta)
            entries[name] = {"kernel": kernel, "constexprs": values,
                             "cubin": f"sm_{arch}/{name}.cubin",
                             "metadata": f"sm_{arch}/{name}.json", "bytes": len(cubin),
                             "sha256": hashlib.sha256(cubin).hexdigest(), "num_warps": warps,
                             "shared": compiled.metadata.shared}
    return index


def compile_cubins(spec: KernelSpec, out: Path, src: Path, archs: tuple[int, ...] = ARCHS,
                   env: dict | None = None, timeout: float = 600) -> dict:
    """Compile in a child process (rendered sources cached in `src`); the index of what was
    written under `out`, or ToolchainError."""
    cmd = [sys.executable, "-m", "dspark.kernels.aot", json.dumps(asdict(spec)), str(out),
           ",".join(map(str, archs)), str(src)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ToolchainError(f"the Triton compiler did not run: {e}") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise ToolchainError(f"Triton cannot compile for CUDA here: {last}")
    return json.loads(r.stdout)


def main() -> None:
    spec = KernelSpec(**json.loads(sys.argv[1]))
    archs = tuple(int(a) for a in sys.argv[3].split(","))
    print(json.dumps(_compile(spec, Path(sys.argv[2]), archs, Path(sys.argv[4]))))


if __name__ == "__main__":
    main()
