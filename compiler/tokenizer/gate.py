"""dsc compile's tokenizer gate: identical tokenizers pass silently; different ones are
refused (pointing to ds-tokenizer-check) unless a draft->main token map is given
(--token-map FILE) or requested (--auto-token-map)."""

from __future__ import annotations

from pathlib import Path

from dspark.compiler.tokenizer.check import compare, load, token_map
from dspark.compiler.tokenizer.files import find_tokenizer
from dspark.runtime.bundle.token_map import TokenMap
from dspark.runtime.errors import DSparkError


def draft_tokenizer(arg: Path | None, draft_path: Path) -> Path | None:
    return find_tokenizer(arg, draft_path) if arg is not None else (
        draft_path.parent if (draft_path.parent / "tokenizer.json").is_file() else None)


def resolve_token_map(main_folder: Path | None, draft_folder: Path | None,
                      map_file: Path | None, auto: bool) -> TokenMap | None:
    if map_file is not None:
        return TokenMap.load(map_file)
    if main_folder is None or draft_folder is None:
        if auto:
            raise DSparkError("--auto-token-map needs both tokenizers (--tokenizer and "
                              "--draft-tokenizer, or tokenizer.json beside each model)")
        return None
    if (main_folder / "tokenizer.json").read_bytes() == \
            (draft_folder / "tokenizer.json").read_bytes():
        return None
    draft, main = load(draft_folder, "--draft-tokenizer"), load(main_folder, "--tokenizer")
    report = compare(draft, main)
    if report.aligned:
        return None
    if auto:
        return token_map(draft, main)
    differs = [s.text for s in report.segmentations if s.first_divergence is not None]
    raise DSparkError(
        f"{draft.path}: the draft tokenizer differs from the main one ({main.path}): "
        f"{report.differing_ids} ids map to different strings, {len(differs)} test strings "
        f"segment differently (e.g. {differs[0]!r}); see ds-tokenizer-check --draft-model "
        f"{draft_folder} --main-model {main_folder}, then pass --token-map FILE (its "
        "--write-mapping) or --auto-token-map" if differs else
        f"{draft.path}: the draft tokenizer differs from the main one ({main.path}); see "
        f"ds-tokenizer-check, then pass --token-map FILE or --auto-token-map")
