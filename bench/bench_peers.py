"""dsrun against onnxruntime-genai and llama.cpp on the same SmolLM2 weights, interleaved.

    python bench/bench_peers.py --setup        # once: peer venv and models (peer_setup.py)
    python bench/bench_peers.py [--repeats 2] [--temperature 0.7] [--systems ...]
                                  [--background-load | --load-from-start] [--json OUT]
    python bench/bench_peers.py --model gemma3 [--setup]   # Gemma 3 270M against genai

Systems (peer_workers.py), each in its own long-lived process, loaded and warmed up once:
    dsrun-fp32-plain|default       the sample bundle (fp32 main, its 4-bit copy as draft)
    dsrun-q4-plain|default         the main on the GGUF's own grid (dsc quantize), lookup
    dsrun-genai4-plain|default     onnxruntime-genai's int4 build compiled by dsc, lookup
    dsrun-optimum-plain|default    optimum's export compiled by dsc, the sample's draft
                                   (not in the default set: --systems)
    genai-fp32|int4-plain|ngram    onnxruntime-genai, intra_op_num_threads = cores
    llama-f32-plain|draft|ngram    llama.cpp on an F32 copy of the GGUF (draft: the Q4_1 GGUF)
    llama-q4_1-plain|ngram         llama.cpp on the GGUF as downloaded
--model gemma3 runs the Gemma 3 sample (a base model: samples/prompts/base_prompts.jsonl, as
plain text) against onnxruntime-genai's fp32 build of the same weights:
    dsrun-gemma3-plain|default     the sample bundle (fp32 main, its 4-bit copy as draft)
    dsrun-gemma3genai-plain|default  genai's build compiled by dsc (lookup drafting)
    genai-gemma3-plain|ngram       onnxruntime-genai
The driver hands every prompt to every process in turn, the order rotated per prompt and
repeat, so each system runs the same prompts under the same machine conditions (this VM's
speed drifts by 10-30% over minutes). Every prompt is tokenized once with the bundle's chat
template and fed as ids to all of them. tok/s = new tokens / (prefill + decode) seconds over
a class's prompts and repeats. Ratios: to dsrun-fp32-plain, to the fastest onnxruntime-genai
mode and the fastest lossless llama.cpp mode (greedy: its tokens equal its plain mode's) of
the same weights (fp32 systems against the fp32/F32 peers, int4 ones against the int4/Q4_1
peers); the ratio to a system's own plain mode comes with a 90% bootstrap interval over the
paired calls; "same" compares each speculative mode's greedy tokens with its own plain mode's.
--background-load keeps one core busy with another process for the whole run (speculation
must never lose to plain then either). A system name may end in @tN: that worker runs with N
threads (DSPARK_THREADS for dsrun; @tauto, @tadaptive: DSPARK_THREADS=auto, adaptive),
beside the same system at the core count, e.g. `--systems dsrun-q4-plain dsrun-q4-plain@t1`.
A name may also end in #N: another process of the same system (an A/A check: how far two
processes of one system differ in one run), its own plain mode the plain of the same #N.
--load-from-start starts that load before the systems load and warm up (a steady load,
what DSPARK_THREADS=auto sees). --one-process serves the modes of one dsrun bundle (same
threads, same #N) from one process, each request naming its mode, as a server's clients
turn speculation on and off per request: their ratio then carries no process-to-process
spread (two processes of one system differed by up to 6% with a core busy). The report
starts with the CPU's model and flags.
With DSPARK_CPU_ISA=avx2 (dsrun's MatMulInt4 on its AVX2 path) the llama.cpp systems run a
build for AVX2 without AVX-512 (built on the first such run, peer_setup.py), so both engines
run the code an AVX2-only CPU would; onnxruntime's dispatch cannot be forced.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import peer_setup as setup
from revision import revision

HERE = Path(__file__).resolve().parent
SAMPLES = HERE.parent / "samples"
PROMPTS = SAMPLES / "prompts" / "peer_prompts.jsonl"
SYSTEMS = ["dsrun-fp32-plain", "dsrun-fp32-default", "dsrun-q4-plain", "dsrun-q4-default",
           "dsrun-genai4-plain", "dsrun-genai4-default", "genai-fp32-plain", "genai-fp32-ngram",
           "genai-int4-plain", "genai-int4-ngram", "llama-f32-plain", "llama-f32-draft",
           "llama-f32-ngram", "llama-q4_1-plain", "llama-q4_1-ngram"]
INT4 = ("q4", "genai4", "int4", "q4_1")  # variants on 4-bit weights
MODELS = {"smollm2": (SYSTEMS, PROMPTS, "fp32"),  # default systems, prompts, tokenizer's bundle
          "gemma3": (["dsrun-gemma3-plain", "dsrun-gemma3-default", "dsrun-gemma3genai-plain",
                      "dsrun-gemma3genai-default", "genai-gemma3-plain", "genai-gemma3-ngram"],
                     SAMPLES / "prompts" / "base_prompts.jsonl", "gemma3")}


def log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


def prompt_ids(path: Path, bundle: str = "fp32") -> list[dict]:
    from dspark.runtime.bundle.tokenizer import load_tokenizer
    from dspark.runtime.sequence.prompt import entry_ids, load_prompts

    tokenizer = load_tokenizer(setup.BUNDLES[bundle] / "tokenizer")
    return [{"name": p["name"], "class": p["class"], "ids": entry_ids(tokenizer, p)}
            for p in load_prompts(path)]


def split_threads(system: str) -> tuple[str, str | None]:
    """(the system without its @tN and #N suffixes, N: a count or "auto" (dsrun's
    DSPARK_THREADS), None without a suffix)."""
    name, _, threads = system.partition("#")[0].partition("@t")
    return name, threads or None


def worker_cmd(system: str, args) -> list[str]:
    name, threads = split_threads(system)
    kind, variant, mode = name.split("-", 2)
    python = str(setup.VENV / "bin" / "python") if kind == "genai" else sys.executable
    count = threads if threads and threads.isdigit() else str(os.cpu_count() or 1)
    return [python, str(HERE / "peer_workers.py"), kind, variant, mode, str(args.max_tokens),
            str(args.temperature), count]


def worker_env(system: str, args) -> dict[str, str]:
    """dsrun workers run with glibc's huge-page tunable, as the dsrun command sets it for
    itself; the peers as their users run them, or with the same tunable if asked."""
    from dspark.runtime.env import hugepage_env

    if not system.startswith("dsrun"):
        return hugepage_env() or dict(os.environ) if args.peer_hugepages else dict(os.environ)
    env = hugepage_env() or dict(os.environ)
    threads = split_threads(system)[1]
    if threads:
        env["DSPARK_THREADS"] = threads
    return env


def process_of(system: str, args) -> tuple[str, str | None]:
    """(the process that serves `system`, the mode a request line names there or None): with
    --one-process a dsrun system's mode is replaced by "*" (its bundle's shared process)."""
    if not (getattr(args, "one_process", False) and system.startswith("dsrun-")):
        return system, None
    base = re.split("@t|#", system, maxsplit=1)[0]
    kind, variant, mode = base.split("-", 2)
    return f"{kind}-{variant}-*{system[len(base):]}", mode


def start(systems: list[str], args) -> dict[str, subprocess.Popen]:
    """One process per process_of key, loaded and warmed up (every mode it serves)."""
    modes: dict[str, list[str]] = {}
    for system in systems:
        key, mode = process_of(system, args)
        modes.setdefault(key, []).append(mode)
    workers = {}
    for key, served in modes.items():
        log(f"starting {key}" + (f" ({', '.join(served)})" if served[0] else ""))
        cmd = worker_cmd(key, args)
        if served[0]:
            cmd[4] = ",".join(served)
        workers[key] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env=worker_env(key, args))
        if workers[key].stdout.readline().strip() != "ready":
            sys.exit(f"{key} failed to start")
    return workers


def drive(args, count: int) -> dict[str, list[dict]]:
    spin = [sys.executable, "-c", "while True: pass"]
    load = subprocess.Popen(spin) if getattr(args, "load_from_start", False) else None
    workers: dict[str, subprocess.Popen] = {}
    runs: dict[str, list[dict]] = {s: [] for s in args.systems}
    try:
        workers = start(args.systems, args)
        if load is None and args.background_load:
            load = subprocess.Popen(spin)
        for r in range(args.repeats):
            log(f"repeat {r + 1}/{args.repeats}")
            for i in range(count):
                k = (r * count + i) % len(args.systems)
                for system in args.systems[k:] + args.systems[:k]:
                    key, mode = process_of(system, args)
                    worker = workers[key]
                    worker.stdin.write(f"{i} {r * count + i}" + (f" {mode}\n" if mode else "\n"))
                    worker.stdin.flush()
                    line = worker.stdout.readline()
                    if not line:
                        sys.exit(f"{system} died")
                    runs[system].append(json.loads(line))
    finally:
        if load is not None:
            load.kill()
        for w in workers.values():
            w.stdin.close()
            w.wait(timeout=60)
    return runs


def ratio_interval(runs: list[dict], base: list[dict], draws: int = 2000, seed: int = 0
                   ) -> tuple[float, float]:
    """A 90% interval for throughput(runs) / throughput(base), the two lists paired by
    position (the same prompt and seed): a bootstrap over the pairs. Sampled outputs differ
    in length and speed from prompt to prompt and seed to seed, and with a core busy one
    call's speed moves against the next one's (paired greedy calls of one process: 0.79-1.27
    of each other), so a class's ratio from a few calls moves."""
    import numpy as np

    rng = np.random.default_rng(seed)
    counts = np.array([[len(x["tokens"]), len(y["tokens"])] for x, y in zip(runs, base)], float)
    secs = np.array([[x["seconds"], y["seconds"]] for x, y in zip(runs, base)], float)
    picks = rng.integers(0, len(runs), (draws, len(runs)))
    tok, sec = counts[picks].sum(axis=1), secs[picks].sum(axis=1)
    ratios = (tok[:, 0] / sec[:, 0]) / (tok[:, 1] / sec[:, 1])
    return float(np.quantile(ratios, 0.05)), float(np.quantile(ratios, 0.95))


def _plain_of(system: str) -> str:
    name, threads = split_threads(system)
    replica = system.partition("#")[2]
    return (name.rsplit("-", 1)[0] + "-plain" + (f"@t{threads}" if threads else "")
            + (f"#{replica}" if replica else ""))


def _lossless(system: str, same: bool | None) -> bool:
    """Plain, or speculation whose greedy tokens equal its plain mode's (sampled: assumed)."""
    return split_threads(system)[0].endswith("-plain") or same is not False


def _best(tps: dict[str, float], kind: str, int4: bool, same: dict | None) -> float | None:
    """The fastest mode of peer `kind` on weights of the same precision (with `same`: the
    fastest lossless one)."""
    picks = [t for s, t in tps.items() if s.startswith(kind + "-")
             and (s.split("-")[1] in INT4) == int4 and (same is None or _lossless(s, same[s]))]
    return max(picks) if picks else None


def summarise(runs: dict[str, list[dict]], args) -> dict:
    classes = sorted({x["class"] for xs in runs.values() for x in xs})
    greedy = args.temperature == 0
    rows = []
    for cls in classes:
        mine = {s: [x for x in xs if x["class"] == cls] for s, xs in runs.items()}
        tps = {s: sum(len(x["tokens"]) for x in xs) / sum(x["seconds"] for x in xs)
               for s, xs in mine.items()}
        same = {s: (all(x["tokens"] == y["tokens"] for x, y in zip(xs, mine[_plain_of(s)]))
                    if greedy and _plain_of(s) in mine else None) for s, xs in mine.items()}
        base = "dsrun-fp32-plain" if "dsrun-fp32-plain" in tps else None
        for system, xs in mine.items():
            int4 = system.split("-")[1] in INT4
            genai, llama = _best(tps, "genai", int4, None), _best(tps, "llama", int4, same)
            plain = _plain_of(system)
            rows.append({
                "class": cls, "system": system, "tps": tps[system],
                "vs_own_plain": tps[system] / tps[plain] if plain in tps else None,
                "vs_own_plain_90": (ratio_interval(xs, mine[plain])
                                    if plain in tps and plain != system else None),
                "vs_dsrun_fp32_plain": tps[system] / tps[base] if base else None,
                "vs_best_genai": tps[system] / genai if genai else None,
                "vs_best_llama": tps[system] / llama if llama else None,
                "same_as_own_plain": same[system]})
    return {"cpu": cpu_line(args.systems), "revision": args.revision, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "temperature": args.temperature,
            "background_load": args.background_load or args.load_from_start,
            "load_from_start": args.load_from_start,
            "one_process": getattr(args, "one_process", False),
            "peer_hugepages": args.peer_hugepages, "rows": rows,
            "prompts": {s: [{k: x[k] for k in ("name", "class", "seconds")} | {
                "tokens": len(x["tokens"])} for x in xs] for s, xs in runs.items()}}


def cpu_line(systems: list[str] = ()) -> str:
    """The CPU's model and flags and the paths dsrun is forced to (device.cpu_line), and
    the llama.cpp build when `systems` run llama.cpp on one not this CPU's own."""
    from dspark.runtime.model.device import cpu_line as line

    target = setup.llama_target()
    llama = any(s.startswith("llama-") for s in systems)
    return line() + ("" if target == "native" or not llama else (
        f"; llama.cpp built for {target} without AVX-512; onnxruntime's kernels on their "
        "own dispatch (cannot be forced)"))


def _x(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def format_report(report: dict) -> str:
    lines = [report["cpu"],
             f"{report['max_tokens']} new tokens, temperature {report['temperature']}, "
             f"{report['repeats']} repeats, systems interleaved per prompt"
             + (", one core busy with another process" if report["background_load"] else "")
             + (" (from before the systems started)" if report.get("load_from_start") else "")
             + ("; each dsrun bundle's modes in one process" if report.get("one_process")
                else ""),
             f"{'class':<6}{'system':<25}{'tok/s':>7}{'own plain':>11}{'(90%)':>12}"
             f"{'dsrun fp32':>11}{'best genai':>11}{'best llama':>11}  same as own plain"]
    for r in report["rows"]:
        band = r.get("vs_own_plain_90")
        band = f"{band[0]:.2f}-{band[1]:.2f}" if band else "-"
        same = {True: "yes", False: "NO", None: "-"}[r["same_as_own_plain"]]
        lines.append(f"{r['class']:<6}{r['system']:<25}{r['tps']:>7.1f}"
                     f"{_x(r['vs_own_plain']):>11}{band:>12}{_x(r['vs_dsrun_fp32_plain']):>11}"
                     f"{_x(r['vs_best_genai']):>11}{_x(r['vs_best_llama']):>11}  {same}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", action="store_true", help="build the peers and the bundles")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2",
                   help="the weights every system runs (default systems and prompts follow)")
    p.add_argument("--prompt-file", type=Path)
    p.add_argument("--systems", nargs="+",
                   help="among: " + " ".join(SYSTEMS) + " (and dsrun-<bundle>-<method>)")
    p.add_argument("--background-load", action="store_true",
                   help="keep one core busy with another process during the run")
    p.add_argument("--load-from-start", action="store_true",
                   help="the same, started before the systems load (a steady load they "
                        "start beside, as DSPARK_THREADS=auto measures it)")
    p.add_argument("--one-process", action="store_true",
                   help="serve a dsrun bundle's modes from one process (per-request mode)")
    p.add_argument("--peer-hugepages", action="store_true",
                   help="give the peers glibc's huge-page tunable too (like for like)")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args()
    if args.setup:
        setup.setup(args.model)
        return
    systems, prompt_file, tokenizer = MODELS[args.model]
    args.systems = args.systems or systems
    prompts = prompt_ids(args.prompt_file or prompt_file, tokenizer)
    os.environ["DSPARK_PEER_PROMPTS"] = json.dumps(prompts)
    args.revision = revision()  # what the workers run, before anything can change it
    if any(s.startswith("llama-") for s in args.systems):
        setup.setup_llamacpp(setup.llama_target())  # the AVX2 build, on its first forced run
    report = summarise(drive(args, len(prompts)), args)
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
