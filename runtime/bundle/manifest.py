"""manifest.json as a type: the compiler builds a Manifest and writes `to_dict()`; the reader
parses the file back with `from_dict` into the same type (models as ModelSpec). Its fields are
the bundle's record of what was compiled, how, and every immutable file's hash."""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark.runtime.bundle.spec import ModelSpec
from dspark.runtime.errors import BundleError


@dataclass(frozen=True)
class Manifest:
    format_version: int
    compiler: dict  # name, version
    inputs: dict[str, dict]  # per role: the input model's file, size and sha256
    flags: dict  # the compile options that shape the bundle
    models: dict[str, ModelSpec]
    files: dict[str, dict]  # bundle-relative path -> {sha256, size} (all but the manifest)
    stage1: dict[str, dict] = field(default_factory=dict)  # per role: the graph passes' report
    tokenizer: tuple[str, ...] = ()  # the tokenizer files copied in
    token_map: str | None = None  # the draft->main token map's file, when the vocabularies differ
    kernels: dict = field(default_factory=dict)  # mode, archs, triton, reason

    def to_dict(self) -> dict:
        return {"format_version": self.format_version, "compiler": self.compiler,
                "inputs": self.inputs, "flags": self.flags,
                "models": {r: s.to_dict() for r, s in self.models.items()},
                "stage1": self.stage1, "tokenizer": list(self.tokenizer),
                "token_map": self.token_map, "kernels": self.kernels, "files": self.files}

    @classmethod
    def from_dict(cls, data: dict, where: str) -> Manifest:
        """Parse a manifest read from `where`; BundleError naming what is malformed."""
        try:
            return cls(
                format_version=data["format_version"], compiler=dict(data["compiler"]),
                inputs=dict(data["inputs"]), flags=dict(data["flags"]),
                models={role: ModelSpec.from_dict(d) for role, d in data["models"].items()},
                files=dict(data["files"]), stage1=dict(data.get("stage1") or {}),
                tokenizer=tuple(data.get("tokenizer") or ()), token_map=data.get("token_map"),
                kernels=dict(data.get("kernels") or {}))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise BundleError(f"{where}: malformed manifest ({e!r})") from None

    @property
    def total_bytes(self) -> int:
        return sum(entry["size"] for entry in self.files.values())
