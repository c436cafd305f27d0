"""dsrun: serve a bundle, generate from it, benchmark it; and ds-tokenizer-check."""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import click

from dspark.runtime.cli.cluster import cluster
from dspark.runtime.cli.util import run_cli, with_hugepages
from dspark.runtime.errors import DSparkError
from dspark.runtime.model.device import DEVICES
from dspark.runtime.sequence.prompt import prompt_ids as encode_prompt
from dspark.runtime.sequence.request import GenerationRequest, Sequence
from dspark.runtime.sequence.sampling import SamplingParams
from dspark.runtime.version import __version__

PathArg = click.Path(path_type=Path)
device_option = click.option(
    "--device", type=click.Choice(DEVICES), default="auto", show_default=True,
    help="cuda when a GPU and onnxruntime-gpu are present, else cpu; force either")


def say(message: str) -> None:
    click.echo(f"[dsrun] {message}", err=True)


def kv_options(fn):
    """The loading flags, shared by serving, generate and bench: the KV cache's (a KVOptions
    as `kv`) and --quiet (`say`: where the load's progress lines go, None when quiet)."""
    from dspark.runtime.cache.layout import KV_DTYPES

    options = [
        click.option("--kv-cache-memory", "kv_memory", type=click.FloatRange(min=1),
                     help="KV cache size in MiB (default: room for twice --max-batch "
                     "full-length sequences, within 40% of the memory available)"),
        click.option("--kv-cache-dtype", "kv_dtype", type=click.Choice(KV_DTYPES),
                     help="cache keys and values as this type (default: the model's; "
                     "float16 and int8 are another model function, exact against it)"),
        click.option("--no-prefix-cache", is_flag=True,
                     help="compute every prompt's KV (no reuse between requests)"),
        click.option("--max-seq-len", type=click.IntRange(min=1),
                     help="the longest prompt + output served (default: the bundle's)"),
        click.option("--quiet", "-q", is_flag=True,
                     help="no progress lines on stderr while loading"),
    ]
    for option in reversed(options):
        fn = option(fn)

    def wrapped(*args, kv_memory, kv_dtype, no_prefix_cache, max_seq_len, quiet, **kwargs):
        from dspark.runtime.engine.loader import KVOptions

        return fn(*args, kv=KVOptions(kv_memory, kv_dtype, not no_prefix_cache, max_seq_len),
                  say=None if quiet else say, **kwargs)
    return functools.update_wrapper(wrapped, fn)


drafter_option = click.option(
    "--drafter", type=click.Choice(["hybrid", "lookup", "draft"]),
    help="drafting method (default: the config's drafting.method)")


def serve_options(fn):
    """The serving flags, shared by `dsrun --model B`, `dsrun serve` and ds-inference-server."""
    options = [
        click.option("--host", default="127.0.0.1", show_default=True),
        click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True),
        click.option("--api-key", help="require Authorization: Bearer KEY (or DSPARK_API_KEY)"),
        click.option("--max-batch", type=click.IntRange(1, 1024), default=16, show_default=True),
        click.option("--max-queue", type=click.IntRange(1, 100000), default=256,
                     show_default=True, help="waiting requests before 429"),
        click.option("--max-body-mb", type=click.FloatRange(min=0.001), default=8.0,
                     show_default=True, help="larger request bodies get a 413"),
        click.option("--no-warmup", is_flag=True, help="skip the warm-up at start"),
        click.option("--drain-timeout", "drain_s", type=click.FloatRange(min=0), default=30.0,
                     show_default=True, help="on SIGTERM, seconds the requests in flight may "
                     "take to finish (new ones get 503)"),
        click.option("--config", "config_path", type=PathArg, help="dflash_config.json to use"),
        click.option("--policy", help="window policy (default: the config's)"),
        click.option("--served-model-name", "name", help="model id in the API (default: "
                     "the bundle's name)"),
        device_option,
    ]
    for option in reversed(options):
        fn = option(fn)
    return kv_options(fn)


def _serve(model: Path, host, port, api_key, max_batch, max_queue, max_body_mb, no_warmup,
           drain_s, config_path, policy, name, device, kv, say) -> None:
    from dspark.runtime.server.run import serve

    click.echo(f"[dsrun] serving {model} on http://{host}:{port}/v1", err=True)
    serve(model, host, port, api_key=api_key, max_batch=max_batch, max_queue=max_queue,
          max_body_bytes=int(max_body_mb * 2**20), warmup=not no_warmup, config=config_path,
          policy=policy, name=name, device=device, drain_s=drain_s, kv=kv, say=say)


@click.group(invoke_without_command=True,
             help="DSpark runtime: `dsrun --model B` serves the OpenAI API; generate and "
                  "bench run locally.")
@click.option("--model", type=PathArg, help="bundle to serve")
@serve_options
@click.version_option(__version__, prog_name="dsrun")
@click.pass_context
def cli(ctx: click.Context, model: Path | None, **serve_kwargs) -> None:
    if ctx.invoked_subcommand is None:
        if model is None:
            raise click.UsageError("give --model BUNDLE to serve, or a command (generate, bench)")
        _serve(model, **serve_kwargs)


def _prompt_ids(tokenizer, prompt: str | None, prompt_ids: str | None, chat: str | None
                ) -> list[int]:
    if sum(x is not None for x in (prompt, prompt_ids, chat)) != 1:
        raise click.UsageError("give exactly one of --prompt, --prompt-ids, --chat")
    ids = None
    if prompt_ids is not None:
        try:
            ids = [int(t) for t in prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise click.BadParameter("comma-separated integers expected",
                                     param_hint="--prompt-ids") from None
    if tokenizer is None and ids is None:
        raise DSparkError("the bundle has no tokenizer: use --prompt-ids")
    return encode_prompt(tokenizer, prompt, chat, ids)


def _schema_grammar(path: Path) -> str:
    from dspark.runtime.grammar.formats import schema_grammar

    try:
        schema = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DSparkError(f"--json-schema {path}: not a readable JSON file ({e})") from None
    return schema_grammar(schema, f"--json-schema {path}")


def result_dict(seq: Sequence, tokenizer, elapsed: float) -> dict:
    text = tokenizer.decode(seq.generated) if tokenizer else None
    if text is not None and seq.text_end is not None:
        text = text[: seq.text_end]
    return {
        "token_ids": seq.generated, "text": text, "finish_reason": seq.finish_reason,
        "stats": {
            **seq.stats.summary(),
            "tokens_per_s": round(len(seq.generated) / elapsed, 3) if elapsed > 0 else None,
            "ttft_ms": round(seq.ttft_s * 1000, 2) if seq.ttft_s is not None else None,
        },
    }


@cli.command()
@click.option("--model", type=PathArg, required=True, help="the .dsmodel bundle")
@click.option("--prompt", help="prompt text")
@click.option("--prompt-ids", help="prompt token ids, comma-separated")
@click.option("--chat", help="a user message, wrapped in the bundle's chat template")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(0, 100), default=0.0, show_default=True)
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0)
@click.option("--top-k", type=click.IntRange(min=0), default=0)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--window", type=click.IntRange(min=1), help="fixed draft window")
@click.option("--policy", help="window policy: fixed, dflash, goodput (default: config)")
@click.option("--config", "config_path", type=PathArg, help="dflash_config.json to use")
@click.option("--tenant", default="default", show_default=True)
@click.option("--no-speculative", is_flag=True, help="plain decoding with the main model")
@click.option("--json-schema", "schema_path", type=PathArg,
              help="a JSON schema file the output must follow (structured output)")
@drafter_option
@device_option
@click.option("--json", "as_json", is_flag=True)
@kv_options
def generate(model: Path, prompt, prompt_ids, chat, max_tokens: int, temperature: float,
             top_p: float, top_k: int, seed, stop, window, policy, config_path, tenant: str,
             no_speculative: bool, schema_path, drafter, device: str, as_json: bool,
             kv, say) -> None:
    """Generate one completion from a bundle."""
    from dspark.runtime.engine.loader import load_engine

    grammar = _schema_grammar(schema_path) if schema_path is not None else None
    engine, tokenizer = load_engine(model, window, policy=policy, config=config_path,
                                    device=device, kv=kv, say=say, cost_cache=True)
    ids = _prompt_ids(tokenizer, prompt, prompt_ids, chat)
    if grammar is not None:
        if engine.grammars is None:
            raise DSparkError(f"--json-schema: the bundle {model} has no tokenizer")
        engine.grammars.check(grammar, f"--json-schema {schema_path}")
    request = GenerationRequest(tuple(ids), max_tokens, SamplingParams(temperature, top_p, top_k,
                                                                       seed),
                                tuple(stop), speculative=not no_speculative, tenant=tenant,
                                method=drafter, grammar=grammar)
    t0 = time.perf_counter()
    [seq] = engine.generate([request])
    out = result_dict(seq, tokenizer, time.perf_counter() - t0)
    if as_json:
        click.echo(json.dumps(out))
        return
    click.echo(out["text"] if out["text"] is not None else ",".join(map(str, seq.generated)))
    st = out["stats"]
    click.echo(f"[dsrun] {len(seq.generated)} tokens, {st['tokens_per_s']} tok/s, "
               f"TTFT {st['ttft_ms']} ms, finish {seq.finish_reason}, {st['rounds']} rounds, "
               f"accepted {st['accepted_tokens']}/{st['draft_tokens']} drafts "
               f"({st['mean_accepted_per_round']:.2f} per round)", err=True)


@cli.command()
@click.option("--model", type=PathArg, required=True)
@click.option("--prompts", type=PathArg, help="JSONL prompts (default: the shipped set)")
@click.option("--max-tokens", type=click.IntRange(min=1), default=96, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--window", type=click.IntRange(min=1), help="draft window (default: config)")
@click.option("--policy", help="window policy: fixed, dflash, goodput (default: config)")
@click.option("--policies", help="sweep instead, e.g. 'fixed:1-8,dflash,goodput,lookup,hybrid'")
@click.option("--config", "config_path", type=PathArg, help="dflash_config.json to use")
@click.option("--json", "as_json", is_flag=True)
@click.option("--plot", type=PathArg, help="write acceptance and tokens/s per prompt (PNG)")
@click.option("--profile", is_flag=True,
              help="instead: where a decode and a verify step spend their time")
@click.option("--context", type=click.IntRange(min=1), default=100, show_default=True,
              help="--profile: cached tokens the steps attend to")
@click.option("--verify-tokens", type=click.IntRange(min=2), default=5, show_default=True,
              help="--profile: tokens of the verify step")
@click.option("--background-load", is_flag=True,
              help="keep one core busy with another process while measuring")
@drafter_option
@device_option
@kv_options
def bench(model: Path, prompts, max_tokens: int, repeats: int, window, policy, policies,
          config_path, as_json: bool, plot, profile: bool, context: int, verify_tokens: int,
          background_load: bool, drafter, device: str, kv, say) -> None:
    """Speculative vs plain decoding on the same prompts, interleaved, in one process."""
    from dspark.runtime.cli.bench import busy_core

    with busy_core(background_load):
        _bench(model, prompts, max_tokens, repeats, window, policy, policies, config_path,
               as_json, plot, (context, verify_tokens) if profile else None, drafter, device,
               kv, say)


def _bench(model: Path, prompts, max_tokens: int, repeats: int, window, policy, policies,
           config_path, as_json: bool, plot, profile: tuple[int, int] | None, drafter,
           device: str, kv, say) -> None:
    from dspark.runtime.cli.bench import (
        format_report,
        format_sweep,
        parse_modes,
        plot_report,
        run_bench,
        run_sweep,
    )
    from dspark.runtime.engine.loader import load_engine
    from dspark.runtime.sequence.prompt import load_prompts

    engine, tokenizer = load_engine(model, window, policy=policy, config=config_path,
                                    device=device, kv=kv, say=say)
    if profile:
        from dspark.runtime.cli.profile import format_profile, profile_engine

        context, verify_tokens = profile
        if context + verify_tokens > engine.limits.max_seq_len:
            raise click.BadParameter(
                f"{context} cached + {verify_tokens} verified tokens exceed the bundle's "
                f"context length, {engine.limits.max_seq_len}", param_hint="--context")
        report = profile_engine(engine, context, verify_tokens, repeats=max(5, 5 * repeats))
        click.echo(json.dumps(report, indent=2) if as_json else format_profile(report))
        return
    if policies:
        report = run_sweep(engine, tokenizer, load_prompts(prompts), max_tokens, repeats,
                           parse_modes(policies))
        click.echo(json.dumps(report, indent=2) if as_json else format_sweep(report))
        return
    report = run_bench(engine, tokenizer, load_prompts(prompts), max_tokens, repeats, drafter)
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))
    if plot:
        plot_report(report, plot)


@cli.command()
@click.option("--model", type=PathArg, required=True)
@serve_options
def serve(model: Path, **serve_kwargs) -> None:
    """Serve the OpenAI-compatible API."""
    _serve(model, **serve_kwargs)


@click.command(help="Serve a .dsmodel bundle over the OpenAI-compatible API.")
@click.option("--model", type=PathArg, required=True)
@serve_options
def inference_server(model: Path, **serve_kwargs) -> None:
    _serve(model, **serve_kwargs)


cli.add_command(cluster)


def main() -> None:
    with_hugepages()
    run_cli(cli, "dsrun", sys.argv[1:])


def inference_server_main() -> None:
    with_hugepages()
    run_cli(inference_server, "ds-inference-server", sys.argv[1:])

