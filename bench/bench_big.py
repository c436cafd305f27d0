"""A 1B-class family pair, end to end: what compile, verify and load cost, and where
speculation pays at that scale.

The pair is samples/big_pair.py's (random-init, TinyLlama-1.1B's shape, SmolLM2's tokenizer,
a two-layer draft of the main's first layers): bundle a is the fp32 main with the int4
draft, bundle b the int4 main with the same draft. Measured, one command after another on
this machine (bench/rss_watch.py samples each process tree's RSS):
  - `dsc compile` of a and b: peak RSS against the main's weights, seconds;
  - `dsc verify` of a: peak RSS, seconds, whether it reported progress;
  - `dsrun generate --max-tokens 1`, a first load (every file hashed, the cost table
    measured) and a second (both remembered), end to end, with dsrun's load phases;
  - running RSS: `dsrun generate --max-tokens 32`'s peak against the bundle's size;
  - `dsrun bench` of b and a (plain and default speculation, interleaved): tok/s,
    acceptance, c and the bound.
The CPU heads the report. About 15 minutes on 2 cores; 12 GB of disk under build/big.

    python bench/bench_big.py [--out build/big] [--json build/reports/big.json]
        [--skip-bench] [--load-repeats N] [--loads-only]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

from revision import revision
from rss_watch import watch

from dspark.runtime.model.device import cpu_line

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "samples"))  # its builders
import big_pair  # noqa: E402

GIB = 2**30


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def weights_bytes(model: Path) -> int:
    """An ONNX model's bytes with its external data (every file beside it that it names)."""
    import onnx

    proto = onnx.load(str(model), load_external_data=False)
    files = {e.value for t in proto.graph.initializer for e in t.external_data
             if e.key == "location"}
    return model.stat().st_size + sum((model.parent / f).stat().st_size for f in files)


def run(cmd: list[str], what: str, env=None) -> dict:
    got = watch(cmd, env=env)
    if got.returncode != 0:
        sys.exit(f"{what} failed (exit {got.returncode}):\n" + "\n".join(got.stderr[-20:]))
    phases = {m.group(1): float(m.group(2)) for line in got.stderr
              if (m := re.match(r"\[dsrun\] (.+?) in ([0-9.]+)s", line))}
    return {"seconds": round(got.seconds, 2), "peak_gib": round(got.peak_bytes / GIB, 2),
            "progress_lines": sum(line.startswith("[dsc]") for line in got.stderr),
            "phases": phases, "last": got.stderr[-1] if got.stderr else ""}


def compile_bundle(out: Path, main: Path, draft: Path, name: str) -> dict:
    bundle = out / f"{name}.dsmodel"
    got = run(["dsc", "compile", str(main), str(draft), "-o", str(bundle), "--force"],
              f"dsc compile {name}")
    got["main_weights_gib"] = round(weights_bytes(main) / GIB, 2)
    got["over_weights"] = round(got["peak_gib"] / got["main_weights_gib"], 2)
    got["bundle_gib"] = round(dir_bytes(bundle) / GIB, 2)
    return got


def loads(bundle: Path, cache: Path, repeats: int = 1) -> dict:
    """A first load (nothing remembered) and `repeats` later ones (the median's phases
    reported, every one's seconds kept), `dsrun generate --max-tokens 1`."""
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "DSPARK_CACHE": str(cache)}
    cmd = ["dsrun", "generate", "--model", str(bundle), "--prompt", "The", "--max-tokens", "1"]
    first = run(cmd, "first load", env)
    seconds = sorted((run(cmd, "second load", env) for _ in range(repeats)),
                     key=lambda r: r["seconds"])
    running = run([*cmd[:-1], "32"], "32 tokens", env)
    size = dir_bytes(bundle) / GIB
    return {"first": first, "second": seconds[len(seconds) // 2],
            "second_all": [r["seconds"] for r in seconds],
            "running_peak_gib": running["peak_gib"], "bundle_gib": round(size, 2),
            "running_over_bundle": round(running["peak_gib"] / size, 2)}


def bench(bundle: Path) -> dict:
    import subprocess

    out = subprocess.run(["dsrun", "bench", "--model", str(bundle), "--max-tokens", "48",
                          "--repeats", "1", "--json"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"dsrun bench failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def table(results: dict) -> list[str]:
    """The report as a markdown table (docs/benchmarks.md)."""
    rows = [line.split(": ", 1) for line in report_lines(results)]
    return ["| what | measured |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)]


def report_lines(results: dict) -> list[str]:
    out = []
    print = out.append  # noqa: A001 - one line each
    print(f"pair: {results.get('pair', '')}")
    for name, c in results["compile"].items():
        print(f"dsc compile {name}: {c['seconds']:.0f} s, peak RSS {c['peak_gib']:.2f} GiB = "
              f"{c['over_weights']:.2f}x the main's weights ({c['main_weights_gib']:.2f} GiB); "
              f"bundle {c['bundle_gib']:.2f} GiB")
    for name, v in results.get("verify", {}).items():
        print(f"dsc verify {name}: {v['seconds']:.0f} s, peak RSS {v['peak_gib']:.2f} GiB = "
              f"{v['over_weights']:.2f}x the main's weights, {v['progress_lines']} progress "
              f"lines; {v['last']}")
    if results.get("load_revision", results.get("revision")) != results.get("revision"):
        print(f"loads measured at: {results['load_revision']} (the rest at "
              f"{results.get('revision')})")
    for name, ld in results["load"].items():
        for which in ("first", "second"):
            x = ld[which]
            phases = ", ".join(f"{k} {v:.1f}s" for k, v in x["phases"].items())
            runs = ld.get("second_all", []) if which == "second" else []
            spread = (f"the median of {len(runs)}, {runs[0]:.1f}-{runs[-1]:.1f} s; "
                      if len(runs) > 1 else "")
            print(f"dsrun generate {name}, {which} load: {x['seconds']:.1f} s end to end "
                  f"({spread}{phases})")
        print(f"running RSS {name}: {ld['running_peak_gib']:.2f} GiB = "
              f"{ld['running_over_bundle']:.2f}x the bundle ({ld['bundle_gib']:.2f} GiB)")
    for name, b in results.get("bench", {}).items():
        for row in b.get("classes", []):
            print(f"dsrun bench {name} {row['name']}: plain {row['tps_plain']:.1f} tok/s, "
                  f"default {row['tps_spec']:.1f} ({row['speedup']:.2f}x), acceptance "
                  f"{row['acceptance_rate']:.2f}, c {row['c']:.2f}, bound {row['bound']:.2f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("build/big"))
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--skip-bench", action="store_true", help="costs only, no dsrun bench")
    p.add_argument("--load-repeats", type=int, default=1, help="later loads measured each")
    p.add_argument("--loads-only", action="store_true",
                   help="the loads alone, of the bundles already in --out; with --json, they "
                        "replace the loads of the report there (its revision noted apart)")
    args = p.parse_args()
    if args.loads_only:
        return loads_only(args)
    big_pair.build(args.out, 22)
    main_fp32, main_q4, draft = (args.out / f for f in ("main.onnx", "main-q4.onnx",
                                                         "draft.onnx"))
    results: dict = {"cpu": cpu_line(), "revision": revision(),
                     "pair": "random-init 1.2B Llama (TinyLlama-1.1B's shape, SmolLM2's "
                             "tokenizer) and its first two layers as the draft"}
    results["compile"] = {"a (fp32 main)": compile_bundle(args.out, main_fp32, draft, "a"),
                          "b (int4 main)": compile_bundle(args.out, main_q4, draft, "b")}
    verify = run(["dsc", "verify", str(args.out / "a.dsmodel"), "--main", str(main_fp32),
                  "--draft", str(draft)], "dsc verify a")
    verify["over_weights"] = round(verify["peak_gib"] / (weights_bytes(main_fp32) / GIB), 2)
    results["verify"] = {"a": verify}
    results["load"] = {name: loads(args.out / f"{name}.dsmodel", args.out / f"cache-{name}",
                                   args.load_repeats) for name in ("a", "b")}
    if not args.skip_bench:
        results["bench"] = {name: bench(args.out / f"{name}.dsmodel") for name in ("b", "a")}
    print(results["cpu"])
    print("\n".join(report_lines(results)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


def loads_only(args) -> None:
    """Measure the loads again; print them, and put them in the report at --json if any."""
    results = json.loads(args.json.read_text()) if args.json and args.json.exists() else {}
    if results.get("cpu", cpu_line()) != cpu_line():
        sys.exit(f"{args.json} was measured on another CPU ({results['cpu']}): run it whole")
    results.setdefault("cpu", cpu_line())
    results.setdefault("compile", {})
    results["load"] = {name: loads(args.out / f"{name}.dsmodel", args.out / f"cache-{name}",
                                   args.load_repeats) for name in ("a", "b")}
    results["load_revision"] = revision()
    print(results["cpu"])
    print("\n".join(line for line in report_lines(results) if line.startswith(("dsrun generate",
                                                                              "running RSS"))))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
