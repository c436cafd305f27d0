"""`dsc compile`: two ONNX models in, one verified .dsmodel bundle out.

    check inputs -> [per model] optimize -> verify-nodes (+ segments, weights)
                 -> kernels -> layout -> tokenizer, config, manifest -> atomic rename
"""

from __future__ import annotations

import hashlib
import re
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from dspark.compiler.bundle_writer import check_output, list_files, publish, staged_bundle
from dspark.compiler.contract import InputContract, check_contract, load_header, model_file
from dspark.compiler.kernel_stage import build_kernels
from dspark.compiler.max_length import LengthLimitError, default_length
from dspark.compiler.model_pipeline import compile_model
from dspark.compiler.progress import Progress
from dspark.compiler.tokenizer.files import copy_tokenizer, find_tokenizer, tokenizer_vocab_size
from dspark.compiler.tokenizer.gate import draft_tokenizer, resolve_token_map
from dspark.runtime.bundle.bundle import MEMORY_PLAN_FILE, TOKENIZER_DIR, dump_json
from dspark.runtime.bundle.config import CONFIG_FILE, CONFIG_SCHEMA_FILE, DFlashConfig
from dspark.runtime.bundle.config_schema import config_schema
from dspark.runtime.bundle.manifest import Manifest
from dspark.runtime.bundle.memory_plan import plan_memory
from dspark.runtime.bundle.token_map import TOKEN_MAP_FILE, TokenMap
from dspark.runtime.cache.layout import seq_bytes
from dspark.runtime.errors import DSparkError, ModelInputError
from dspark.runtime.version import BUNDLE_FORMAT_VERSION, __version__

ROLES = ("main", "draft")
EXTRA_DRAFT = re.compile(r"[a-z0-9_]{1,32}$")


@dataclass(frozen=True)
class CompileOptions:
    main: Path
    draft: Path | None  # None: a lookup-only bundle (drafting from the context, no model)
    out: Path
    tokenizer: Path | None = None
    force: bool = False
    kv_budget_mb: float = 512.0
    block_size: int = 16
    max_seq_len: int | None = None  # None: the smaller of 2048 and what the models run
    extra_drafts: tuple[tuple[str, Path], ...] = ()  # (name, path): role "draft_<name>"
    draft_tokenizer: Path | None = None
    token_map: Path | None = None
    auto_token_map: bool = False
    aot: bool = True  # compile the kernels to cubin (else the bundle is JIT-only)
    lean: bool = True  # stage 1's shape folding and rotary fusion (off: the graph as exported)

    def __post_init__(self) -> None:
        names = [n for n, _ in self.extra_drafts]
        for name in names:
            if not EXTRA_DRAFT.match(name):
                raise DSparkError(f"--extra-draft {name}: a name is 1-32 of a-z, 0-9, _")
        if len(set(names)) != len(names):
            raise DSparkError(f"--extra-draft names must be unique, got {names}")
        if self.draft is None and (names or self.draft_tokenizer or self.token_map
                                   or self.auto_token_map):
            raise DSparkError("--extra-draft, --draft-tokenizer, --token-map and "
                              "--auto-token-map need a DRAFT model")

    def flags(self) -> dict:
        return {"kv_budget_mb": self.kv_budget_mb, "block_size": self.block_size,
                "max_seq_len": self.max_seq_len,
                "extra_drafts": [n for n, _ in self.extra_drafts], "lean": self.lean}

    def vocab_checked(self, role: str) -> bool:
        """A draft with a token map may have its own vocabulary."""
        return not (role == "draft" and (self.token_map or self.auto_token_map))

    @property
    def roles(self) -> tuple[str, ...]:
        if self.draft is None:
            return ("main",)
        return (*ROLES, *(f"draft_{n}" for n, _ in self.extra_drafts))

    def model_path(self, role: str) -> Path:
        paths = {"main": self.main, "draft": self.draft}
        paths.update({f"draft_{n}": p for n, p in self.extra_drafts})
        return paths[role]


def _digest(contract: InputContract) -> dict:
    """sha256 over the model file and the external data files it names."""
    h = hashlib.sha256()
    for path in (contract.path, *(contract.path.parent / f for f in contract.data_files)):
        try:
            h.update(path.read_bytes())
        except OSError as e:
            raise ModelInputError(f"{path}: cannot read ({e.strerror})") from None
    return {"file": contract.path.name, "sha256": h.hexdigest()}


def _check_vocab(paths: dict[str, Path], vocab: dict[str, int | None]) -> None:
    if vocab["main"] and vocab["draft"] and vocab["main"] != vocab["draft"]:
        raise ModelInputError(
            f"{paths['draft']}: draft vocab size {vocab['draft']} != main vocab size "
            f"{vocab['main']} ({paths['main']}); draft tokens must be main token ids"
        )


def check_inputs(opts: CompileOptions
                 ) -> tuple[dict[str, InputContract], Path | None, TokenMap | None]:
    files = {r: model_file(opts.model_path(r)) for r in opts.roles}
    contracts = {r: check_contract(files[r], load_header(files[r])) for r in opts.roles}
    for role in (r for r in opts.roles[1:] if opts.vocab_checked(r)):
        _check_vocab({"main": opts.main, "draft": opts.model_path(role)},
                     {"main": contracts["main"].vocab_size, "draft": contracts[role].vocab_size})
    tokenizer = find_tokenizer(opts.tokenizer, files["main"])
    if tokenizer is not None:
        tokenizer_vocab_size(tokenizer)
    mapping = None
    if opts.draft is not None:
        mapping = resolve_token_map(tokenizer, draft_tokenizer(opts.draft_tokenizer,
                                                               files["draft"]),
                                    opts.token_map, opts.auto_token_map)
    check_output(opts.out, opts.force)
    return contracts, tokenizer, mapping


def _check_map(mapping: TokenMap, opts: CompileOptions, vocab: dict[str, int]) -> None:
    where = opts.token_map or "--auto-token-map"
    if len(mapping.draft_to_main) > vocab["draft"] or mapping.main_vocab > vocab["main"]:
        raise DSparkError(f"{where}: maps {len(mapping.draft_to_main)} draft ids onto "
                          f"{mapping.main_vocab} main ids; the models have {vocab['draft']} "
                          f"and {vocab['main']}")


def compile_bundle(opts: CompileOptions, progress: Progress) -> Manifest:
    """Compile and publish the bundle; returns the manifest. Without a max_seq_len, the
    length is the smaller of 2048 and the models' own limits (compiler/max_length.py)."""
    contracts, tokenizer, mapping = check_inputs(opts)
    if opts.max_seq_len is not None:
        return _compile(opts, contracts, tokenizer, mapping, progress)
    length, why = default_length([c.path for c in contracts.values()])
    progress.say(f"max_seq_len {length}: {why} (--max-seq-len sets it)")
    try:
        return _compile(replace(opts, max_seq_len=length), contracts, tokenizer, mapping,
                        progress)
    except LengthLimitError as e:
        progress.say(f"max_seq_len {e.runs}: the most the models run (onnxruntime refused "
                     f"{length} positions); compiling again at {e.runs}")
        return _compile(replace(opts, max_seq_len=e.runs), contracts, tokenizer, mapping,
                        progress)


def _compile(opts: CompileOptions, contracts: dict[str, InputContract], tokenizer: Path | None,
             mapping: TokenMap | None, progress: Progress) -> Manifest:
    with tempfile.TemporaryDirectory(prefix="dsc-") as work, staged_bundle(opts.out) as tmp:
        built = {r: compile_model(contracts[r], r, Path(work), tmp, progress, opts.max_seq_len,
                                  opts.lean) for r in opts.roles}
        specs = {r: spec for r, (spec, _) in built.items()}
        vocab = {r: s.vocab_size for r, s in specs.items()}
        # checked before the build where the logits' dim is static; here for the rest (a
        # symbolic dim, resolved from the weights)
        for role in (r for r in opts.roles[1:] if opts.vocab_checked(r)):
            _check_vocab({"main": opts.main, "draft": opts.model_path(role)},
                         {"main": vocab["main"], "draft": vocab[role]})
        if mapping is not None:
            _check_map(mapping, opts, vocab)
            (tmp / TOKEN_MAP_FILE).write_bytes(dump_json(mapping.to_json()))
        with progress.stage("layout"):
            models = [specs[r] for r in opts.roles]
            plan = plan_memory(models, int(opts.kv_budget_mb * 2**20), opts.block_size,
                               opts.max_seq_len, seq_bytes(models, opts.block_size,
                                                           opts.max_seq_len))
            (tmp / MEMORY_PLAN_FILE).write_bytes(dump_json(plan.to_dict()))
        with progress.stage("kernels"):
            kernels = build_kernels(specs, plan, tmp, Path(work), progress, opts.aot)
        tokenizer_files = _write_tokenizer(tokenizer, tmp, vocab["main"])
        (tmp / CONFIG_FILE).write_bytes(dump_json(DFlashConfig().to_dict()))
        (tmp / CONFIG_SCHEMA_FILE).write_bytes(dump_json(config_schema()))
        manifest = Manifest(
            format_version=BUNDLE_FORMAT_VERSION,
            compiler={"name": "dsc", "version": __version__},
            inputs={r: _digest(contracts[r]) for r in opts.roles}, flags=opts.flags(),
            models=specs, files=list_files(tmp),
            stage1={r: report for r, (_, report) in built.items()},
            tokenizer=tuple(tokenizer_files),
            token_map=TOKEN_MAP_FILE if mapping is not None else None,
            kernels={"mode": kernels["mode"], "archs": kernels["archs"],
                     "triton": kernels.get("triton"), "reason": kernels.get("reason")})
        publish(tmp, opts.out, manifest)
    return manifest


def _write_tokenizer(folder: Path | None, tmp: Path, vocab: int) -> list[str]:
    if folder is None:
        return []
    size = tokenizer_vocab_size(folder)
    if size > vocab:
        raise DSparkError(f"{folder}/tokenizer.json: {size} tokens, more than the model's "
                          f"vocab size {vocab}")
    return copy_tokenizer(folder, tmp / TOKENIZER_DIR)
