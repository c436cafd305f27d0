"""Compiled test bundles cached by input hash, like the exported fixtures.

The key covers what a compile reads: the models' folders (file names, sizes, mtimes), the
tokenizer and token-map inputs, every option, and the source of the compiler, runtime,
kernels and templates. A hit is hard-linked into the test's own folder (bundles are written
by rename, never in place, so a test rewriting one of its files does not touch the cache);
a miss compiles into a temporary folder renamed into the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

from dspark.compiler.compile import CompileOptions, compile_bundle
from dspark.compiler.progress import Progress

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "build" / "test-bundles"
SOURCES = ("compiler", "runtime", "kernels", "templates")
SMALL = 1 << 20


def compiled(options: CompileOptions) -> Path:
    """options.out, holding the bundle those options compile (from the cache when it can)."""
    key = _key(options)
    cached = CACHE / key
    if not cached.is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = CACHE / f".{key}.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        compile_bundle(dataclasses.replace(options, out=tmp, force=True), Progress(quiet=True))
        try:
            os.rename(tmp, cached)
        except OSError:  # another process put it there first
            shutil.rmtree(tmp, ignore_errors=True)
    if options.out.exists():
        shutil.rmtree(options.out)
    shutil.copytree(cached, options.out, copy_function=_link)
    return options.out


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _key(options: CompileOptions) -> str:
    fields = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
              if f.name not in ("out", "force")}
    inputs = {name: _describe(value) for name, value in fields.items()}
    blob = json.dumps({"inputs": inputs, "source": _source_hash()}, sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _describe(value):
    """A path as its folder's listing (a model's external data sits beside it)."""
    if isinstance(value, tuple):
        return [_describe(v) for v in value]
    if not isinstance(value, Path):
        return value
    folder = value if value.is_dir() else value.parent
    return [value.name, sorted(_file(p, folder) for p in folder.rglob("*") if p.is_file())]


def _file(path: Path, folder: Path) -> tuple:
    """Small files (tokenizers, maps) by content; large ones (weights) by size and mtime."""
    stat = path.stat()
    if stat.st_size < SMALL:
        return str(path.relative_to(folder)), hashlib.sha256(path.read_bytes()).hexdigest()
    return str(path.relative_to(folder)), stat.st_size, stat.st_mtime_ns


_SOURCE: list[str] = []


def _source_hash() -> str:
    if not _SOURCE:
        h = hashlib.sha256()
        for top in SOURCES:
            for path in sorted((ROOT / top).rglob("*")):
                if path.is_file() and "__pycache__" not in path.parts:
                    h.update(str(path.relative_to(ROOT)).encode())
                    h.update(path.read_bytes())
        _SOURCE.append(h.hexdigest())
    return _SOURCE[0]
