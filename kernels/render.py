"""Kernel sources rendered from templates/ (jinja2), as a pure, memoised function of a spec,
and loaded as Python modules (Triton needs a real file to read a kernel's source)."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path
from types import ModuleType

import jinja2

from dspark.kernels.spec import KernelSpec

TEMPLATES = ("verify_attention", "kv_cache")


@functools.cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.PackageLoader("dspark.templates", ""),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


@functools.cache
def render(template: str, spec: KernelSpec) -> str:
    """The kernel module's source for `spec`: same spec, same text."""
    return _environment().get_template(f"{template}.py.jinja").render(spec=spec)


@functools.cache
def load(template: str, spec: KernelSpec, cache_dir: str, interpret: bool = False
         ) -> ModuleType:
    """Import the rendered module from `cache_dir` (written once, named by its content).
    `interpret`: Triton's interpreter, for CPU tensors (tests); else compiled for the GPU."""
    import triton

    text = render(template, spec)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"{template}_{digest}.py"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.rename(path)
    name = f"dspark_kernel_{digest}{'_interpreted' if interpret else ''}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    previous = triton.knobs.runtime.interpret
    triton.knobs.runtime.interpret = interpret
    try:
        module_spec.loader.exec_module(module)
    finally:
        triton.knobs.runtime.interpret = previous
    return module
