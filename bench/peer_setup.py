"""What the peer benchmark runs, made once and cached under build/peers (bench/bench_peers.py).

    python bench/bench_peers.py --setup [--model gemma3]
    python bench/peer_setup.py optimum-venv   # prints optimum's venv's bin folder (made once)
    python bench/peer_setup.py llama-build    # the llama.cpp build this run uses, as JSON

- onnxruntime-genai in its own venv (build/peers/venv: torch from the local CPU wheel, the
  builder's needs), its fp32 and int4 builds of SmolLM2 from a plain HF folder of the GGUF
  (build/peers/hf, genai, genai-int4), intra_op_num_threads set to the core count (its
  default oversubscribes 2 cores);
- llama.cpp's llama-server and llama-quantize, built with cmake from the source the
  llama-cpp-python sdist vendors (build/llamacpp), the GGUF's own Q4_1 file and an F32 copy;
  a second build for AVX2 without AVX-512 (build/llamacpp/build-avx2), made by the first run
  with DSPARK_CPU_ISA=avx2;
- DSpark bundles beside build/smollm2.dsmodel (make demo): the main on the GGUF's own grid
  (`dsc quantize` of the fp32 main: 4-bit projections with mins, an 8-bit head), drafting by
  lookup and by its own 4-bit copy's first layers is not made here (see the README), and
  onnxruntime-genai's int4 build compiled by dsc, and optimum's export of the same weights
  (build/peers/venv-optimum, optimum) compiled by dsc with the sample's draft;
- with `--model gemma3`: genai's fp32 build of the Gemma 3 sample's weights
  (build/peers/gemma3-hf, gemma3-genai) and that build compiled by dsc
  (build/gemma3-genai.dsmodel), beside build/gemma3.dsmodel (samples/gemma3.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "build" / "peers"
VENV = PEERS / "venv"
HF_DIR = PEERS / "hf"
GENAI = {"fp32": PEERS / "genai", "int4": PEERS / "genai-int4", "gemma3": PEERS / "gemma3-genai"}
GEMMA3_HF = PEERS / "gemma3-hf"
BUILDER = ROOT / "samples" / "genai_builder.py"  # genai's builder, Gemma 3's rope adapted
OPTIMUM_VENV = PEERS / "venv-optimum"  # optimum-onnx pins transformers 4
OPTIMUM = PEERS / "optimum"  # its export of the SmolLM2 HF folder
LLAMA = ROOT / "build" / "llamacpp"
# llama.cpp's builds: "native" for this CPU (GGML_NATIVE), "avx2" for a Haswell-level CPU
# (AVX2, FMA, F16C, BMI2, no AVX-512), what it runs beside dsrun forced to its AVX2 path
LLAMA_BUILDS = {"native": ["-DGGML_NATIVE=ON"],
                "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                         "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF"]}
GGUF = {"q4_1": None, "f32": LLAMA / "SmolLM2-135M-Instruct.F32.gguf"}  # q4_1: the package's
BUNDLES = {"fp32": ROOT / "build" / "smollm2.dsmodel",
           "q4": ROOT / "build" / "smollm2-q4.dsmodel",
           "genai4": ROOT / "build" / "smollm2-genai-int4.dsmodel",
           "optimum": ROOT / "build" / "smollm2-optimum.dsmodel",
           "gemma3": ROOT / "build" / "gemma3.dsmodel",
           "gemma3genai": ROOT / "build" / "gemma3-genai.dsmodel"}
STORE_PROMPTS = ROOT / "samples" / "prompts" / "datastore_prompts.jsonl"
PEER_PACKAGES = ["onnxruntime-genai", "onnx_ir", "onnxscript", "transformers", "onnx", "numpy"]
LLAMA_SDIST = "llama-cpp-python"


def log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


def run(cmd: list, **kw) -> None:
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def q41_gguf() -> Path:
    sys.path.insert(0, str(ROOT / "samples"))
    from smollm2 import gguf_path

    return gguf_path()


def setup(model: str = "smollm2") -> None:
    if model == "gemma3":
        setup_gemma3()
    else:
        setup_genai()
        setup_llamacpp()
        setup_bundles()
        setup_optimum()
    log("ready")


def optimum_venv() -> Path:
    """The venv with optimum-cli (build/peers/venv-optimum: optimum-onnx pins transformers 4,
    beside torch's CPU wheel and onnxruntime), made now if missing; its bin folder."""
    bin_dir = OPTIMUM_VENV / "bin"
    if not (bin_dir / "optimum-cli").exists():
        log("creating the optimum venv ...")
        run([sys.executable, "-m", "venv", OPTIMUM_VENV])
        run([bin_dir / "pip", "install", "--quiet", "--no-compile", "torch==2.13.0",
             "optimum-onnx", "onnxruntime"])
    return bin_dir


def setup_optimum() -> None:
    """optimum's export of the same SmolLM2 weights (`optimum-cli export onnx --task
    text-generation-with-past`, in its own venv: it pins transformers 4, which reads
    `rope_theta` where transformers 5 writes `rope_parameters`), compiled by dsc with the
    sample's draft."""
    optimum_venv()
    if not (OPTIMUM / "model.onnx").exists():
        hf4 = PEERS / "hf-transformers4"
        if not (hf4 / "config.json").exists():
            shutil.copytree(HF_DIR, hf4, dirs_exist_ok=True)
            config = json.loads((hf4 / "config.json").read_text())
            config.setdefault("rope_theta", config.get("rope_parameters", {}).get("rope_theta"))
            (hf4 / "config.json").write_text(json.dumps(config, indent=2))
        log("exporting the HF folder with optimum ...")
        run([OPTIMUM_VENV / "bin" / "optimum-cli", "export", "onnx", "--model", hf4, "--task",
             "text-generation-with-past", OPTIMUM])
    if not BUNDLES["optimum"].exists():
        sample = ROOT / "build" / "smollm2"
        run([Path(sys.executable).parent / "dsc", "compile", OPTIMUM / "model.onnx",
             sample / "draft.onnx", "-o", BUNDLES["optimum"], "--tokenizer", sample, "--force"])


def setup_gemma3() -> None:
    """onnxruntime-genai's fp32 build of the Gemma 3 sample's weights (samples/gemma3.py),
    and that build compiled by dsc."""
    if not BUNDLES["gemma3"].exists():
        sys.exit(f"run samples/gemma3.py and dsc compile first (for {BUNDLES['gemma3']})")
    setup_genai()
    if not (GEMMA3_HF / "config.json").exists():
        sys.path.insert(0, str(ROOT / "samples"))
        from gemma3 import gguf_path

        write_hf_folder(gguf_path(ROOT / "build" / "gguf"), GEMMA3_HF)
    folder = GENAI["gemma3"]
    if not (folder / "genai_config.json").exists():
        log("building onnxruntime-genai's fp32 Gemma 3 ...")
        run([VENV / "bin" / "python", BUILDER, "-i", GEMMA3_HF, "-o", folder, "-p", "fp32",
             "-e", "cpu"])
    set_threads(folder / "genai_config.json", os.cpu_count() or 1)
    if not BUNDLES["gemma3genai"].exists():
        log("compiling onnxruntime-genai's Gemma 3 build ...")
        run([Path(sys.executable).parent / "dsc", "compile", folder, "-o",
             BUNDLES["gemma3genai"], "--force"])


def setup_genai() -> None:
    if not (VENV / "bin" / "python").exists():
        log("creating the onnxruntime-genai venv ...")
        run([sys.executable, "-m", "venv", VENV])
        pip = [VENV / "bin" / "pip", "install", "--quiet", "--no-compile"]
        run([*pip, "torch==2.13.0"])
        run([*pip, *PEER_PACKAGES])
    if not (HF_DIR / "config.json").exists():
        write_hf_folder(q41_gguf(), HF_DIR)
    for precision in ("fp32", "int4"):
        folder = GENAI[precision]
        if not (folder / "genai_config.json").exists():
            log(f"building onnxruntime-genai's {precision} model ...")
            run([VENV / "bin" / "python", BUILDER, "-i", HF_DIR, "-o", folder, "-p", precision,
                 "-e", "cpu"])
        set_threads(folder / "genai_config.json", os.cpu_count() or 1)


def write_hf_folder(gguf: Path, out: Path) -> None:
    """A GGUF's model as a plain HF folder (a GGUF-loaded model refuses save_pretrained:
    its weights are copied into a fresh model of the same config)."""
    from gguf_sample import load_model
    from transformers import AutoModelForCausalLM

    log("writing the HF folder from the GGUF ...")
    model, tokenizer = load_model(gguf)
    fresh = AutoModelForCausalLM.from_config(model.config)
    fresh.load_state_dict(model.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def set_threads(path: Path, threads: int) -> None:
    config = json.loads(path.read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    path.write_text(json.dumps(config, indent=2))


def llama_target() -> str:
    """The llama.cpp build a run uses: "avx2" while DSPARK_CPU_ISA forces dsrun's MatMulInt4
    to its AVX2 path (both engines then run AVX2 code), else "native"."""
    return "avx2" if os.environ.get("DSPARK_CPU_ISA", "").strip().lower() == "avx2" else "native"


def llama_bin(target: str | None = None) -> Path:
    target = target or llama_target()
    return LLAMA / ("build" if target == "native" else f"build-{target}") / "bin"


def setup_llamacpp(target: str = "native") -> None:
    """llama-server and llama-quantize from the llama-cpp-python sdist's vendored source, for
    `target` (LLAMA_BUILDS), and the F32 copy of the Q4_1 GGUF."""
    bin_dir = llama_bin(target)
    if not (bin_dir / "llama-server").exists():
        LLAMA.mkdir(parents=True, exist_ok=True)
        sdists = sorted(LLAMA.glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            log("downloading the llama-cpp-python sdist ...")
            run([sys.executable, "-m", "pip", "download", LLAMA_SDIST, "--no-binary", ":all:",
                 "--no-deps", "-d", LLAMA])
            sdists = sorted(LLAMA.glob("llama_cpp_python-*.tar.gz"))
        source = LLAMA / sdists[-1].name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
        if not source.exists():
            run(["tar", "xzf", sdists[-1], "-C", LLAMA])
        log(f"building llama-server for {target} (cmake, a few minutes) ...")
        build = bin_dir.parent
        run(["cmake", "-S", source, "-B", build, *LLAMA_BUILDS[target],
             "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"])
        run(["cmake", "--build", build, f"-j{os.cpu_count() or 1}", "--target",
             "llama-server", "llama-quantize"])
    if not GGUF["f32"].exists():
        log("writing the F32 GGUF ...")
        tmp = GGUF["f32"].with_suffix(".tmp")
        run([bin_dir / "llama-quantize", "--allow-requantize", q41_gguf(), tmp, "F32"],
            capture_output=True)
        tmp.rename(GGUF["f32"])


def setup_bundles() -> None:
    """The int4 main on the GGUF's grid (lookup drafting) and genai's int4 build, by dsc."""
    dsc = Path(sys.executable).parent / "dsc"
    sample = ROOT / "build" / "smollm2"
    if not BUNDLES["fp32"].exists():
        sys.exit(f"run `make demo` first (for {BUNDLES['fp32']})")
    if not BUNDLES["q4"].exists():
        log("quantizing the main onto the GGUF's grid and compiling it ...")
        run([dsc, "quantize", sample / "main.onnx", "-o", sample / "main-q4.onnx", "--force"])
        run([dsc, "compile", sample / "main-q4.onnx", "-o", BUNDLES["q4"], "--tokenizer",
             sample, "--force"])
    if not BUNDLES["genai4"].exists():
        log("compiling onnxruntime-genai's int4 build ...")
        run([dsc, "compile", GENAI["int4"], "-o", BUNDLES["genai4"], "--force"])
    # the int4 mains draft by lookup only: a datastore of their own outputs on other prompts
    # lets lookups propose where a request's context has no copy (docs/drafting.md)
    for name in ("q4", "genai4"):
        if not (BUNDLES[name] / "lookup_store.npz").exists():
            log(f"adding a lookup datastore to the {name} bundle ...")
            run([dsc, "datastore", BUNDLES[name], "--prompts", STORE_PROMPTS])


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["optimum-venv", "llama-build"])
    if p.parse_args().what == "optimum-venv":
        print(optimum_venv())
        return
    target = llama_target()
    print(json.dumps({"target": target, "bin": str(llama_bin()),
                      "flags": LLAMA_BUILDS[target]}))


if __name__ == "__main__":
    main()
