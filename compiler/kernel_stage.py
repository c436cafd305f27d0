"""The kernel part of stage 2: DSpark kernels rendered for each model's constants and
compiled ahead of time to cubin (sm_80, sm_90) with Triton's own compiler.

    kernels/index.json                      specs, roles, sources, cubins per arch, mode
    kernels/<spec tag>/verify_attention.py  rendered sources (the JIT path reads these)
    kernels/<spec tag>/kv_cache.py
    kernels/<spec tag>/sm_80/<kernel>.cubin + <kernel>.json (Triton metadata), sm_90/...
A toolchain that cannot target CUDA leaves the bundle JIT-only, saying why.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from dspark.compiler.progress import Progress
from dspark.kernels.aot import ARCHS, ToolchainError, compile_cubins
from dspark.kernels.render import TEMPLATES, render
from dspark.kernels.spec import KernelSpec
from dspark.runtime.bundle.bundle import dump_json
from dspark.runtime.bundle.memory_plan import MemoryPlan
from dspark.runtime.bundle.spec import ModelSpec
from dspark.runtime.env import child_env

KERNELS_DIR = "kernels"


def kernel_spec(spec: ModelSpec, plan: MemoryPlan) -> KernelSpec:
    return KernelSpec(spec.head_dim, spec.num_heads, spec.num_kv_heads, plan.block_size,
                      spec.kv_dtype)


def build_kernels(specs: dict[str, ModelSpec], plan: MemoryPlan, out: Path, work: Path,
                  progress: Progress, aot: bool = True) -> dict:
    """Write kernels/ into the bundle being built; returns its index."""
    by_tag: dict[str, tuple[KernelSpec, list[str]]] = {}
    for role, spec in specs.items():
        ks = kernel_spec(spec, plan)
        by_tag.setdefault(ks.tag, (ks, []))[1].append(role)
    index: dict = {"mode": "aot" if aot else "jit-only", "archs": [], "specs": {}}
    if not aot:
        index["reason"] = "--no-aot"
    env = child_env(("TRITON_INTERPRET",))
    for tag, (ks, roles) in sorted(by_tag.items()):
        folder = out / KERNELS_DIR / tag
        folder.mkdir(parents=True)
        for template in TEMPLATES:
            (folder / f"{template}.py").write_text(render(template, ks))
        entry = {"spec": asdict(ks), "roles": roles,
                 "sources": [f"{KERNELS_DIR}/{tag}/{t}.py" for t in TEMPLATES], "cubins": {}}
        if index["mode"] == "aot":
            try:
                built = compile_cubins(ks, folder, work / "kernel-src", ARCHS, env)
                entry["cubins"] = built["archs"]
                index["triton"] = built["triton"]
            except ToolchainError as e:
                index.update(mode="jit-only", reason=str(e))
                progress.say(f"kernels: JIT-only bundle ({e})")
        index["specs"][tag] = entry
    index["archs"] = sorted({a for e in index["specs"].values() for a in e["cubins"]})
    (out / KERNELS_DIR / "index.json").write_bytes(dump_json(index))
    return index
