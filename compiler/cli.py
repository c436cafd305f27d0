"""dsc: the DSpark compiler CLI (compile, quantize, datastore, inspect, verify)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import click

from dspark.compiler.compile import ROLES, CompileOptions, compile_bundle
from dspark.compiler.inspect_bundle import inspect_dict, inspect_text
from dspark.compiler.progress import Progress
from dspark.runtime.api import run_cli
from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.model.sessions import init_threads
from dspark.runtime.version import __version__

PathArg = click.Path(path_type=Path)


@click.group(help="DSpark compiler: main + draft ONNX -> one .dsmodel bundle.")
@click.version_option(__version__, prog_name="dsc")
def cli() -> None:
    init_threads()


quiet_option = click.option("--quiet", "-q", is_flag=True,
                            help="no progress lines on stderr")


@cli.command("compile")
@click.argument("main", type=PathArg)
@click.argument("draft", type=PathArg, required=False)
@click.option("-o", "--output", "out", type=PathArg, required=True, help="bundle directory")
@click.option("--tokenizer", type=PathArg, help="folder with tokenizer.json (default: MAIN's)")
@click.option("--force", is_flag=True, help="replace OUT if it exists")
@click.option("--kv-budget-mb", type=click.FloatRange(min=1), default=512.0, show_default=True)
@click.option("--block-size", type=click.Choice(["16", "32", "64", "128"]), default="16",
              show_default=True)
@click.option("--max-seq-len", type=click.IntRange(min=1), default=None,
              help="positions a sequence may reach [default: the smaller of 2048 and the "
              "model's own limit]")
@click.option("--extra-draft", "extra", multiple=True, metavar="NAME=PATH",
              help="another draft the runtime may switch to (repeatable)")
@click.option("--draft-tokenizer", type=PathArg, help="the draft's tokenizer folder "
              "(default: DRAFT's folder when it has a tokenizer.json)")
@click.option("--token-map", type=PathArg, help="draft->main token map "
              "(ds-tokenizer-check --write-mapping)")
@click.option("--auto-token-map", is_flag=True, help="map draft tokens to main tokens with "
              "the same string when the tokenizers differ")
@click.option("--no-aot", is_flag=True, help="skip compiling the kernels to cubin (JIT-only)")
@click.option("--no-lean", is_flag=True, help="skip stage 1's shape folding, rotary fusion and "
              "token-major attention (the graph as exported; for A/B and for a model they "
              "mishandle)")
@click.option("--json", "as_json", is_flag=True, help="print the manifest as JSON")
@quiet_option
def compile_cmd(main: Path, draft: Path | None, out: Path, tokenizer: Path | None, force: bool,
                kv_budget_mb: float, block_size: str, max_seq_len: int | None,
                extra: tuple[str, ...], draft_tokenizer: Path | None, token_map: Path | None,
                auto_token_map: bool, no_aot: bool, no_lean: bool, as_json: bool,
                quiet: bool) -> None:
    """Compile MAIN and DRAFT (ONNX, with KV-cache I/O) into the bundle OUT. Without DRAFT
    the bundle drafts by lookup in each request's own context (no draft model)."""
    extras = []
    for item in extra:
        name, sep, path = item.partition("=")
        if not sep or not path:
            raise click.BadParameter(f"{item!r}: expected NAME=PATH", param_hint="--extra-draft")
        extras.append((name, Path(path)))
    opts = CompileOptions(main, draft, out, tokenizer, force, kv_budget_mb, int(block_size),
                          max_seq_len, tuple(extras), draft_tokenizer, token_map,
                          auto_token_map, not no_aot, not no_lean)
    progress = Progress(quiet)
    manifest = compile_bundle(opts, progress)
    if as_json:
        click.echo(json.dumps({"bundle": str(out), "timings_s": progress.timings,
                               **manifest.to_dict()},
                              indent=2, sort_keys=True))
    else:
        size = manifest.total_bytes
        click.echo(f"wrote {out} ({len(manifest.files)} files, {size / 2**20:.1f} MiB) in "
                   f"{sum(progress.timings.values()):.1f}s")


@cli.command("quantize")
@click.argument("main", type=PathArg)
@click.option("-o", "--output", "out", type=PathArg, required=True, help="the draft ONNX file")
@click.option("--head-bits", type=click.Choice(["4", "8"]), default="8", show_default=True,
              help="the LM head's bits (projections are 4)")
@click.option("--force", is_flag=True, help="replace OUT if it exists")
def quantize_cmd(main: Path, out: Path, head_bits: str, force: bool) -> None:
    """A self-speculative draft from MAIN: projections in 4-bit blocks with a min (llama.cpp's
    Q4_1 grid), the LM head at 8 bits (Q8_0); exact where MAIN's weights sit on those grids."""
    from dspark.compiler.quantize import quantize_file

    if out.exists() and not force:
        raise click.UsageError(f"{out} exists (--force replaces it)")
    report = quantize_file(main, out, int(head_bits))
    embedding = (("exactly" if report.embedding_exact else "rounded") if report.embedding
                 else "none found")
    click.echo(f"wrote {out}: {report.projections} projections quantized, {report.exact} of "
               f"them exactly (weights already on the grid), head "
               f"{report.head or 'none found'}, embedding at 8 bits {embedding}, "
               f"{report.kept} float MatMuls kept")


@cli.command("datastore")
@click.argument("bundle", type=PathArg)
@click.option("--prompts", "prompts", type=PathArg, required=True,
              help="JSONL prompts ('chat', 'prompt' or 'prompt_ids' per line), like your traffic")
@click.option("--max-tokens", type=click.IntRange(1, 4096), default=256, show_default=True,
              help="tokens the main writes per prompt")
@click.option("--max-n", type=click.IntRange(1, 8), default=4, show_default=True,
              help="the longest n-gram the store keys on")
def datastore_cmd(bundle: Path, prompts: Path, max_tokens: int, max_n: int) -> None:
    """Add a lookup datastore to BUNDLE: what its main writes after each n-gram, over its own
    greedy outputs on PROMPTS. Lookup drafting falls back to it where a request's context has
    no match; its drafts are verified, so output never changes."""
    from dspark.compiler.datastore import build_datastore

    if not prompts.is_file():
        raise click.UsageError(f"--prompts {prompts}: no such file")
    report = build_datastore(bundle, prompts, max_tokens, max_n)
    click.echo(f"wrote {bundle / 'lookup_store.npz'}: {report.entries} n-grams from "
               f"{report.tokens} tokens the main wrote for {report.prompts} prompts "
               f"({report.bytes / 2**20:.1f} MiB)")


@cli.command("inspect")
@click.argument("bundle", type=PathArg)
@click.option("--json", "as_json", is_flag=True)
def inspect_cmd(bundle: Path, as_json: bool) -> None:
    """Show a bundle's models, segments, memory plan, config and kernels."""
    b = open_bundle(bundle)
    click.echo(json.dumps(inspect_dict(b), indent=2, sort_keys=True) if as_json
               else inspect_text(b))


@cli.command("verify")
@click.argument("bundle", type=PathArg)
@click.option("--main", "main", type=PathArg, required=True, help="the main ONNX model")
@click.option("--draft", "draft", type=PathArg, help="the draft ONNX model (if the bundle has one)")
@click.option("--tolerance", type=click.FloatRange(min=0), default=1e-3, show_default=True,
              help="logits difference allowed beyond --rtol times the logit")
@click.option("--rtol", type=click.FloatRange(min=0), default=1e-5, show_default=True,
              help="difference allowed per unit of the original's |logit|")
@click.option("--seqs", type=click.IntRange(1, 64), default=3, show_default=True)
@click.option("--steps", type=click.IntRange(1, 64), default=4, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--kv-cache-dtype", "kv_dtype", type=click.Choice(["float32", "float16", "int8"]),
              help="check the function served with this cache dtype (dsrun --kv-cache-dtype), "
                   "against the originals with their caches rounded alike")
@click.option("--json", "as_json", is_flag=True)
@quiet_option
def verify_cmd(bundle: Path, main: Path, draft: Path | None, tolerance: float, rtol: float,
               seqs: int, steps: int, seed: int, kv_dtype: str | None, as_json: bool,
               quiet: bool) -> int:
    """Run the originals and the bundle side by side; exit 1 if a logit differs by more than
    tolerance + rtol * |the original's logit|."""
    from dspark.compiler.verify import verify_model

    b = open_bundle(bundle, full_hash=True)
    if (draft is None) != ("draft" not in b.models):
        raise click.UsageError("--draft is needed exactly when the bundle has a draft model")
    progress = Progress(quiet)
    reports = [verify_model(b, role, path, seqs, steps, seed, rtol, kv_dtype, progress)
               for role, path in zip(ROLES, (main, draft)) if path is not None]
    ok = all(r.ok(tolerance) for r in reports)
    if as_json:
        click.echo(json.dumps({"ok": ok, "tolerance": tolerance, "rtol": rtol, "models": [
            {**asdict(r), "limit": r.limit(tolerance), "ok": r.ok(tolerance)} for r in reports]},
            indent=2))
    else:
        for r in reports:
            click.echo(_verdict_line(r, tolerance))
    return 0 if ok else 1


def _verdict_line(r, tolerance: float) -> str:
    line = (f"{r.role:<5} max |logits diff| {r.max_abs_diff:.3g} over {r.tokens} tokens "
            f"({r.steps} steps after prefill, up to {r.longest} positions), top-1 agree "
            f"{r.argmax_agree:.1%}, "
            f"original's own noise {r.noise_floor:.3g}: ")
    if not r.ok(tolerance):
        return line + (f"FAIL ({r.beyond_rtol:.3g} beyond {r.rtol:.2g} x |logit|, limit "
                       f"{r.limit(tolerance):.3g})")
    if r.beyond_rtol > tolerance:
        return line + (f"ok within {r.limit(tolerance):.3g}, the model's own noise "
                       "(not shape-deterministic: float16 rounding, int8 activations, a "
                       "float16 or int8 cache)")
    if r.max_abs_diff > tolerance:
        return line + f"ok within {tolerance:.3g} + {r.rtol:.2g} x |logit|"
    return line + "ok"


def main() -> None:
    run_cli(cli, "dsc", sys.argv[1:])
