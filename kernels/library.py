"""The launchable kernels of one KernelSpec, from one of three sources:

    cubin        the bundle's ahead-of-time cubin for this GPU's arch (no compile at start)
    jit          Triton compiles the rendered source on first launch (cached by Triton)
    interpreter  Triton's CPU interpreter over CPU tensors (tests)
Every kernel is launched the same way, `library.launch(name, grid, *args)`, with all
arguments positional, constexprs included, in the order of aot.KERNELS. A cubin assumes
16-byte aligned tensors; a launch with an unaligned one goes to JIT instead.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from dspark.kernels.aot import ALIGN, KERNELS, ast_source
from dspark.kernels.render import load
from dspark.kernels.spec import KernelSpec

log = logging.getLogger("dspark.kernels")


class KernelLibrary:
    def __init__(self, spec: KernelSpec, cache_dir: str, interpret: bool = False,
                 cubins: dict[str, tuple[Path, Path]] | None = None):
        """cubins: kernel name -> (cubin, metadata json), for the current device's arch."""
        self.spec = spec
        self.cache_dir = cache_dir
        self.interpret = interpret
        self.source = "interpreter" if interpret else "cubin" if cubins else "jit"
        self._compiled = {name: _load_cubin(spec, name, paths, cache_dir)
                          for name, paths in (cubins or {}).items()}

    def launch(self, name: str, grid: tuple[int, ...], *args) -> None:
        compiled = self._compiled.get(name)
        if compiled is not None and all(a.data_ptr() % ALIGN == 0 for a in args
                                        if isinstance(a, torch.Tensor)):
            compiled[grid](*args)
            return
        if name not in KERNELS:
            raise KeyError(f"unknown kernel {name!r}; known: {', '.join(KERNELS)}")
        template, kernel, _, _, warps = KERNELS[name]
        fn = getattr(load(template, self.spec, self.cache_dir, self.interpret), kernel)
        fn[grid](*args, num_warps=warps)


def _load_cubin(spec: KernelSpec, name: str, paths: tuple[Path, Path], cache_dir: str):
    """A Triton CompiledKernel from the bundle's cubin and metadata; the launcher Triton
    builds for it needs the kernel's signature, which the rendered source gives."""
    from triton.compiler import CompiledKernel

    template, kernel, args, values, _ = KERNELS[name]
    src = ast_source(getattr(load(template, spec, cache_dir), kernel), spec, args, values)
    cubin, meta = paths
    digest = hashlib.sha256(cubin.read_bytes()).hexdigest()
    return CompiledKernel(src, {meta.name: str(meta), cubin.name: str(cubin)}, digest)


def for_device(spec: KernelSpec, cache_dir: str, device, bundle_kernels: dict | None = None,
               root: Path | None = None) -> KernelLibrary:
    """The library for `device` (a torch.device): the cubins of the bundle at `root` when it
    carries this GPU's arch, else JIT (the interpreter on the CPU). Logs which and why."""
    if device.type != "cuda":
        log.info("kernels %s: Triton interpreter (CPU tensors)", spec.tag)
        return KernelLibrary(spec, cache_dir, interpret=True)
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    arch = f"sm_{major}{minor}"
    entry = (bundle_kernels or {}).get("specs", {}).get(spec.tag, {})
    built = entry.get("cubins", {}).get(arch)
    if built and root is not None:
        folder = root / "kernels" / spec.tag
        cubins = {name: (folder / e["cubin"], folder / e["metadata"])
                  for name, e in built.items()}
        try:
            library = KernelLibrary(spec, cache_dir, cubins=cubins)
            log.info("kernels %s: ahead-of-time cubins for %s", spec.tag, arch)
            return library
        except Exception as e:  # noqa: BLE001 - a cubin this driver cannot load: JIT instead
            log.warning("kernels %s: the bundle's %s cubins did not load (%s); JIT instead",
                        spec.tag, arch, e)
    else:
        have = sorted(entry.get("cubins", {})) or "none"
        log.info("kernels %s: JIT (device is %s; bundle cubins: %s)", spec.tag, arch, have)
    return KernelLibrary(spec, cache_dir)
