"""The peer benchmark's workers: one system and mode per process (bench/bench_peers.py).

Each loads its model once, warms up, prints "ready", then for every "<prompt index> <seed>"
line on stdin generates and prints one JSON line: the tokens and the seconds from the first
prompt token in to the last new token out (prefill + decode).

    dsrun-<bundle>-<mode>     a DSpark bundle (peer_setup.BUNDLES) in-process; mode plain
                              (no speculation), default, or a drafting method; or several
                              modes, comma-separated, one process serving them all (a line
                              then names its mode: "<prompt index> <seed> <mode>")
    genai-<precision>-<mode>  onnxruntime-genai (its venv), plain or ngram (3-grams, 4 drafts)
    llama-<gguf>-<mode>       llama.cpp's llama-server on a local port; mode plain, draft (the
                              Q4_1 GGUF as draft, 8 tokens) or ngram (ngram-simple, 3-grams,
                              8 drafts); seconds are the server's own (prompt + predicted ms)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import peer_setup as setup

from dspark.runtime.server.ports import free_port


def emit_runs(run, prompts: list[dict], max_tokens: int, modes: tuple[str, ...] = ()) -> None:
    """Serve the driver: a prompt index per stdin line, a JSON result per stdout line. With
    `modes`, run takes a mode too: each is warmed up, and a line names the one it runs."""
    for mode in modes or [None]:  # warm-up: first runs pay allocations
        run(prompts[0]["ids"], 8, 0, *([mode] if mode else []))
    print("ready", flush=True)
    for line in sys.stdin:
        i, seed, *mode = line.split()
        p = prompts[int(i)]
        tokens, seconds, *stats = run(p["ids"], max_tokens, int(seed), *mode)
        print(json.dumps({"name": p["name"], "class": p["class"], "tokens": tokens,
                          "seconds": seconds, **(stats[0] if stats else {})}), flush=True)


def dsrun_worker(bundle: str, mode: str, prompts: list[dict], max_tokens: int,
                 temperature: float) -> None:
    from dspark.runtime.engine.loader import load_engine
    from dspark.runtime.sequence.request import GenerationRequest
    from dspark.runtime.sequence.sampling import SamplingParams

    engine, _ = load_engine(setup.BUNDLES[bundle])
    modes = tuple(mode.split(","))

    def run(ids: list[int], n: int, seed: int, mode: str = modes[0]
            ) -> tuple[list[int], float, dict]:
        method = None if mode in ("plain", "default") else mode
        request = GenerationRequest(tuple(ids), n, SamplingParams(temperature, seed=seed),
                                    speculative=mode != "plain", method=method)
        t0 = time.perf_counter()
        [seq] = engine.generate([request])
        seconds = time.perf_counter() - t0
        solo = getattr(engine.main.model, "solo_forwards", 0)
        return seq.generated, seconds, {"stats": seq.stats.summary(), "solo_forwards": solo,
                                        "main_forwards": engine.main.forwards}

    emit_runs(run, prompts, max_tokens, modes if len(modes) > 1 else ())


def genai_worker(precision: str, mode: str, prompts: list[dict], max_tokens: int,
                 temperature: float) -> None:
    import onnxruntime_genai as og

    folder = setup.GENAI[precision]
    model = og.Model(str(folder))
    config = json.loads((folder / "genai_config.json").read_text())["model"]
    eos = config["eos_token_id"]
    eos = set(eos if isinstance(eos, list) else [eos])
    # window-sized caches (Gemma 3) must hold a whole window: a longer max_length, and the
    # loop below stops after n tokens itself
    window = config["decoder"].get("sliding_window", {}).get("window_size", 0)

    def run(ids: list[int], n: int, seed: int) -> tuple[list[int], float]:
        params = og.GeneratorParams(model)
        search = {"max_length": max(len(ids) + n, window), "do_sample": temperature > 0}
        if temperature > 0:
            search.update(temperature=temperature, random_seed=seed, top_k=0, top_p=1.0)
        params.set_search_options(**search)
        if mode == "ngram":
            params.set_speculative_options(ngram_size=3, max_draft_tokens=4)
        t0 = time.perf_counter()
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        while not generator.is_done() and len(generator.get_sequence(0)) < len(ids) + n:
            generator.generate_next_token()
        out = [int(t) for t in generator.get_sequence(0)[len(ids):]]
        elapsed = time.perf_counter() - t0
        while out and out[-1] in eos:  # dsrun does not emit the EOS token
            out.pop()
        return out, elapsed

    emit_runs(run, prompts, max_tokens)


LLAMA_MODES = {"plain": [],
               "draft": ["--spec-type", "draft-simple", "--spec-draft-n-max", "8"],
               "ngram": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                         "--spec-ngram-simple-size-m", "8"]}


def llama_server(gguf: str, mode: str, threads: int) -> tuple[subprocess.Popen, str]:
    model = setup.GGUF[gguf] or setup.q41_gguf()
    port = free_port()
    cmd = [setup.llama_bin() / "llama-server", "-m", model, "--port", str(port), "-t",
           str(threads), "-tb", str(threads), "-c", "4096", "--parallel", "1",
           *LLAMA_MODES[mode]]
    if mode == "draft":
        cmd += ["-md", setup.q41_gguf(), "-td", str(threads)]
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def llama_worker(gguf: str, mode: str, prompts: list[dict], max_tokens: int,
                 temperature: float, threads: int) -> None:
    import httpx

    proc, url = llama_server(gguf, mode, threads)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

        def run(ids: list[int], n: int, seed: int) -> tuple[list[int], float]:
            body = {"prompt": ids, "n_predict": n, "temperature": temperature, "seed": seed,
                    "cache_prompt": False, "return_tokens": True, "top_k": 0, "top_p": 1.0,
                    "min_p": 0.0}
            r = httpx.post(f"{url}/completion", json=body, timeout=600).json()
            t = r["timings"]
            return [int(x) for x in r["tokens"]], (t["prompt_ms"] + t["predicted_ms"]) / 1000

        emit_runs(run, prompts, max_tokens)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv: list[str]) -> None:
    """peer_workers.py KIND VARIANT MODE MAX_TOKENS TEMPERATURE THREADS (prompts: env)."""
    import os

    kind, variant, mode, max_tokens, temperature, threads = argv
    prompts = json.loads(os.environ["DSPARK_PEER_PROMPTS"])
    args = (variant, mode, prompts, int(max_tokens), float(temperature))
    if kind == "dsrun":
        dsrun_worker(*args)
    elif kind == "genai":
        genai_worker(*args)
    else:
        llama_worker(*args, int(threads))


if __name__ == "__main__":
    main(sys.argv[1:])
