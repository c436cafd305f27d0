"""ds-tokenizer-check: compare a draft's and a main model's tokenizers; exit 0 when aligned,
1 when not (a CI gate), 2 on usage errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from dspark.compiler.tokenizer.check import compare, load, token_map
from dspark.runtime.api import run_cli

PathArg = click.Path(path_type=Path)


def _side_by_side(seg) -> list[str]:
    mark = seg.first_divergence
    lines = [f"  {json.dumps(seg.text, ensure_ascii=False)}"]
    for name, toks in (("draft", seg.draft), ("main ", seg.main)):
        lines.append(f"    {name}: " + " | ".join(
            (f">>{t}<<" if mark is not None and i == mark else t) for i, t in enumerate(toks)))
    lines.append("    identical" if mark is None else f"    first divergence at token {mark}")
    return lines


def render(report, draft_path: Path, main_path: Path) -> str:
    out = [f"draft: {draft_path} (vocab {report.draft_vocab})",
           f"main:  {main_path} (vocab {report.main_vocab})", "special tokens:"]
    for key, s in report.specials.items():
        out.append(f"  {key:<10} draft {s['draft']}  main {s['main']}  "
                   f"{'agree' if s['agree'] else 'DIFFER'}")
    out.append(f"ids mapping to different strings: {report.differing_ids}")
    out += [f"  id {i}: draft {d!r} / main {m!r}" for i, d, m in report.first_differing]
    out.append(f"draft tokens with a main equivalent: {report.mappable} of {report.draft_vocab}")
    differing = [s for s in report.segmentations if s.first_divergence is not None]
    out.append(f"segmentations: {len(report.segmentations) - len(differing)} identical, "
               f"{len(differing)} differ")
    for seg in differing:
        out += _side_by_side(seg)
    out.append(f"aligned: {'yes' if report.aligned else 'NO'}")
    return "\n".join(out)


@click.command(help="Compare a draft's and a main model's tokenizers (each a bundle, a "
                    "tokenizer.json, or a folder with Hugging Face tokenizer files).")
@click.option("--draft-model", type=PathArg, required=True)
@click.option("--main-model", type=PathArg, required=True)
@click.option("--test-string", "strings", multiple=True, help="extra text to compare")
@click.option("--write-mapping", type=PathArg, help="write the draft->main token map here")
@click.option("--json", "as_json", is_flag=True)
def check(draft_model: Path, main_model: Path, strings: tuple[str, ...], write_mapping,
          as_json: bool) -> int:
    draft, main = load(draft_model, "--draft-model"), load(main_model, "--main-model")
    report = compare(draft, main, strings)
    if write_mapping:
        token_map(draft, main).save(write_mapping)
    click.echo(json.dumps(report.to_dict(), ensure_ascii=False, indent=2) if as_json
               else render(report, draft.path, main.path))
    return 0 if report.aligned else 1


def main() -> None:
    run_cli(check, "ds-tokenizer-check", sys.argv[1:])
