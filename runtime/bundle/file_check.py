"""A bundle's files against its manifest: every size, then every sha256, hashed in parallel,
remembered per machine.

Hashing is most of opening a large bundle (a 4.9 GB fp32 one: 5 s on one core). Files are
hashed on a thread each, as many at once as the machine has cores (hashlib lets go of the
GIL while it hashes). A file whose whole hash matched is recorded by what the kernel says
of it: device, inode, size, and the nanosecond modification and change times. At the next
load a file with the same record is not read again; any write to a file moves its change
time, which no user can set back, so a file changed since it was checked is always hashed
again. The records live in DSPARK_CACHE/checked (one small file per bundle path), written
to a temp name and renamed. DSPARK_HASH=full hashes every file at every load, as
`dsc verify` and `dsrun ... --check` do.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dspark.runtime.errors import BundleError


def identity(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def record_path(root: Path, cache_dir: str) -> Path:
    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:20]
    return Path(cache_dir) / "checked" / f"{key}.json"


def _read_records(path: Path) -> dict[str, list]:
    try:
        records = json.loads(path.read_text())
        return records if isinstance(records, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_records(path: Path, records: dict[str, list]) -> None:
    """Best effort: an unwritable cache only costs the next load its hashing."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(records, sort_keys=True))
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)


def check_files(root: Path, files: dict[str, dict], hasher: Callable[[Path], str],
                cache_dir: str | None) -> int:
    """Raise BundleError for the first (by name) file that is missing, of another size, or
    of another sha256 than `files` lists; the count hashed. `cache_dir`: where the records
    of files already checked are kept (None: hash every file)."""
    for rel, entry in sorted(files.items()):
        path = root / rel
        if not path.is_file():
            raise BundleError(f"{path}: missing from bundle")
        if path.stat().st_size != entry["size"]:
            raise BundleError(
                f"{path}: size {path.stat().st_size} != {entry['size']} in manifest (truncated?)"
            )
    store = record_path(root, cache_dir) if cache_dir is not None else None
    records = _read_records(store) if store is not None else {}
    now = {rel: identity(root / rel) for rel in files}
    todo = sorted(rel for rel in files
                  if records.get(rel) != [files[rel]["sha256"], *now[rel]])
    # the largest first, so the last thread to finish is not the one with the biggest file
    todo.sort(key=lambda rel: -files[rel]["size"])
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        digests = dict(zip(todo, pool.map(lambda rel: hasher(root / rel), todo)))
    for rel in sorted(todo):
        if digests[rel] != files[rel]["sha256"]:
            raise BundleError(f"{root / rel}: sha256 does not match the manifest (tampered?)")
    if store is not None and todo:
        _write_records(store, {rel: [files[rel]["sha256"], *now[rel]] for rel in files})
    return len(todo)
