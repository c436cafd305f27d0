"""KV cache bytes one sequence holds, by how the arena keeps it: every position of every
layer (as before KV groups), sliding-window layers trimmed to their window (the default),
and those with a float16 or int8 cache.

    python bench/kv_bytes.py --bundle build/gemma3-8k.dsmodel --tokens 8192

One sequence is fed --tokens - 1 prompt tokens (this repository's docs, repeated) and one
decoded; then the blocks it holds in every group of the arena (main, and a draft with a
cache of its own) are counted, each at its group's bytes per block. A count of blocks, not
a timing: the same on any machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = (("every position, float32", False, None), ("windows trimmed, float32", True, None),
            ("windows trimmed, float16", True, "float16"), ("windows trimmed, int8", True,
                                                           "int8"))


def held_bytes(bundle: Path, tokens: int, windowed: bool, kv_dtype: str | None) -> dict:
    from tokenizers import Tokenizer

    from dspark.runtime.bundle.bundle import open_bundle
    from dspark.runtime.engine.engine import Engine
    from dspark.runtime.sequence.request import GenerationRequest

    b = open_bundle(bundle)
    engine = Engine(b, max_batch=1, kv_dtype=kv_dtype, windowed_kv=windowed,
                    prefix_cache=False, kv_budget=None, max_seq_len=tokens + 1)
    tok = Tokenizer.from_file(str(bundle / "tokenizer" / "tokenizer.json"))
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tok.encode(text).ids
    prompt = tuple((ids * (tokens // len(ids) + 1))[:tokens - 1])
    seq = engine.submit(GenerationRequest(prompt, 2, speculative=False))
    while len(seq.generated) < 1 and not seq.done:
        engine.step()
    groups = {name: g.blocks.held * g.layout.block_bytes
              for name, g in engine.arena.groups.items()}
    return {"positions": seq.main_cached + 1, "bytes": sum(groups.values()), "groups": groups}


def main() -> None:
    from bench_peers import cpu_line
    from revision import revision

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, default=ROOT / "build" / "gemma3-8k.dsmodel")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    measured = revision()
    rows = {name: held_bytes(args.bundle, args.tokens - 1, windowed, dtype)
            for name, windowed, dtype in SETTINGS}
    report = {"cpu": cpu_line(), "revision": measured, "rows": rows,
              "setup": f"{args.bundle.name}, one sequence of {args.tokens} positions"}
    print("\n".join([report["setup"], "", *table(report)]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


def table(report: dict) -> list[str]:
    rows = report["rows"]
    base = rows[SETTINGS[0][0]]["bytes"]
    return ["| arena | KV MiB held | vs every position |", "|---|---|---|", *(
        f"| {name} | {row['bytes'] / 2**20:.1f} | {1 - row['bytes'] / base:.0%} less |"
        for name, row in rows.items())]


if __name__ == "__main__":
    main()
