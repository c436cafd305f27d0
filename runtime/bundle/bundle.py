"""The .dsmodel bundle format: layout, canonical JSON, and the verifying reader.

    manifest.json        format version, compiler version, input hashes, model specs,
                         every file with its sha256 and size
    main/  draft/        model.onnx (whole rewritten graph), segment_NNN.onnx, weights.bin
    dflash_config.json   scheduler parameters (mutable: validated by schema, not by hash)
    memory_plan.json     the unified KV arena plan
    kernels/             index.json; per kernel spec the rendered Triton sources and, per
                         arch (sm_80, sm_90), each kernel's cubin with Triton's metadata
    tokenizer/           tokenizer.json, tokenizer_config.json
The compiler writes through `dump_json` and `file_entry` so reader and writer agree.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from dspark.kernels.spec import KernelSpec
from dspark.runtime.bundle.config import CONFIG_FILE, DFlashConfig, load_config
from dspark.runtime.bundle.datastore import STORE_FILE, Datastore
from dspark.runtime.bundle.file_check import check_files
from dspark.runtime.bundle.manifest import Manifest
from dspark.runtime.bundle.memory_plan import MemoryPlan
from dspark.runtime.bundle.spec import ModelSpec
from dspark.runtime.bundle.token_map import TokenMap
from dspark.runtime.env import read_env
from dspark.runtime.errors import BundleError
from dspark.runtime.version import BUNDLE_FORMAT_VERSION

MANIFEST_FILE = "manifest.json"
MEMORY_PLAN_FILE = "memory_plan.json"
TOKENIZER_DIR = "tokenizer"
KERNELS_INDEX = "kernels/index.json"
MUTABLE_FILES = frozenset({CONFIG_FILE})


def dump_json(obj: object) -> bytes:
    """Canonical JSON: same object, same bytes (bundles are cached by hash)."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entry(path: Path) -> dict:
    return {"sha256": sha256_file(path), "size": path.stat().st_size}


@dataclass(frozen=True)
class Bundle:
    root: Path
    manifest: Manifest
    plan: MemoryPlan
    config: DFlashConfig

    @property
    def models(self) -> dict[str, ModelSpec]:
        return self.manifest.models

    def path(self, rel: str) -> Path:
        return self.root / rel

    def model(self, role: str) -> ModelSpec:
        return self.models[role]

    @property
    def token_map(self) -> TokenMap | None:
        """The draft->main map of the default draft, when its tokenizer differs."""
        name = self.manifest.token_map
        if not name:
            return None
        return TokenMap.load(self.root / name, self.models["draft"].vocab_size,
                             self.models["main"].vocab_size)

    @property
    def draft_models(self) -> dict[str, int]:
        """Draft roles ("draft", "draft_<name>") with their weight bytes."""
        files = self.manifest.files
        return {r: files.get(s.weights_file, {}).get("size", 0)
                for r, s in self.models.items() if r.startswith("draft")}

    @property
    def kernels(self) -> dict:
        """kernels/index.json: the kernel specs, their sources and cubins per arch."""
        try:
            return json.loads((self.root / KERNELS_INDEX).read_text())
        except (OSError, ValueError) as e:
            raise BundleError(f"{self.root / KERNELS_INDEX}: unreadable ({e})") from None

    def kernel_spec(self, role: str) -> KernelSpec:
        for entry in self.kernels["specs"].values():
            if role in entry["roles"]:
                return KernelSpec(**entry["spec"])
        raise BundleError(f"{self.root / KERNELS_INDEX}: no kernel spec for {role!r}")

    @property
    def datastore(self) -> Datastore | None:
        """The lookup datastore `dsc datastore` added (listed, so hash-checked), if any."""
        if STORE_FILE not in self.manifest.files:
            return None
        return Datastore.load(self.root / STORE_FILE)

    @property
    def tokenizer_dir(self) -> Path | None:
        d = self.root / TOKENIZER_DIR
        return d if (d / "tokenizer.json").is_file() else None


def _read_manifest(root: Path) -> Manifest:
    path = root / MANIFEST_FILE
    if not root.exists():
        raise BundleError(f"{root}: no such bundle")
    if not root.is_dir():
        raise BundleError(f"{root}: not a bundle directory")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise BundleError(f"{path}: missing; {root} is not a .dsmodel bundle") from None
    except (OSError, ValueError) as e:
        raise BundleError(f"{path}: unreadable manifest ({e})") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != BUNDLE_FORMAT_VERSION:
        raise BundleError(
            f"{path}: bundle format version {version!r}, this runtime reads "
            f"{BUNDLE_FORMAT_VERSION}; recompile with this dsc"
        )
    return Manifest.from_dict(manifest, str(path))


def _contain(root: Path, files: dict) -> None:
    """Every manifest path names a plain file inside the bundle: no absolute paths, no
    `..`, no symlinks on the way (checked before any of them is opened)."""
    real = root.resolve()
    for rel in sorted(files):
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts or not parts:
            raise BundleError(f"{root / MANIFEST_FILE}: file entry {rel!r} points outside "
                              "the bundle")
        for i in range(1, len(parts) + 1):
            if (root.joinpath(*parts[:i])).is_symlink():
                raise BundleError(f"{root.joinpath(*parts[:i])}: a symlink; a bundle holds "
                                  "plain files only")
        if not (root / rel).resolve().is_relative_to(real):
            raise BundleError(f"{root / MANIFEST_FILE}: file entry {rel!r} points outside "
                              "the bundle")


def open_bundle(path: str | Path, verify: bool = True, config_path: str | Path | None = None,
                full_hash: bool = False) -> Bundle:
    """Load a bundle, checking format version and (by default) every immutable file's size
    and sha256: those this machine hashed before and that have not changed since are not
    hashed again unless `full_hash` or DSPARK_HASH=full (file_check.py)."""
    root = Path(path)
    manifest = _read_manifest(root)
    _contain(root, manifest.files)
    if verify:
        env = read_env()
        records = None if full_hash or env.full_hash else env.cache_dir
        check_files(root, {rel: entry for rel, entry in manifest.files.items()
                           if rel not in MUTABLE_FILES}, sha256_file, records)
    try:
        plan = MemoryPlan.from_dict(json.loads((root / MEMORY_PLAN_FILE).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BundleError(f"{root / MEMORY_PLAN_FILE}: unreadable memory plan ({e!r})") from None
    config = load_config(config_path or root / CONFIG_FILE)
    return Bundle(root, manifest, plan, config)
