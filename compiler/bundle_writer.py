"""Atomic bundle output: everything goes to a temp dir beside OUT, renamed only when complete.

An interrupted or failed compile leaves nothing at OUT (and no temp dir behind).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dspark.runtime.bundle.bundle import MANIFEST_FILE, dump_json, file_entry
from dspark.runtime.bundle.manifest import Manifest
from dspark.runtime.errors import DSparkError


def check_output(out: Path, force: bool) -> None:
    """Refuse early (before any work) an OUT that exists, is a symlink or cannot be written."""
    if out.is_symlink():
        raise DSparkError(f"{out}: is a symbolic link (to {os.readlink(out)}); give the "
                          "bundle's real path")
    if out.exists() and not force:
        raise DSparkError(f"{out}: already exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise DSparkError(f"{out}: exists and is not a bundle directory")
    parent = out.absolute().parent
    if not parent.is_dir():
        raise DSparkError(f"{out}: parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DSparkError(f"{out}: cannot write to {parent} (permission denied)")


@contextmanager
def staged_bundle(out: Path) -> Iterator[Path]:
    """Yields a temp dir beside `out`; removed on any failure, interrupt included."""
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp",
                                    dir=out.absolute().parent))
    except OSError as e:
        parent = out.absolute().parent
        raise DSparkError(f"{out}: cannot write to {parent} ({e.strerror})") from None
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def list_files(root: Path) -> dict[str, dict]:
    return {p.relative_to(root).as_posix(): file_entry(p)
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST_FILE}


def publish(tmp: Path, out: Path, manifest: Manifest) -> None:
    """Write the manifest last, then swap the finished bundle into place."""
    (tmp / MANIFEST_FILE).write_bytes(dump_json(manifest.to_dict()))
    os.chmod(tmp, 0o755)
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
