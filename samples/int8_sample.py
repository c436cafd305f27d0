"""Build the int8 sample: the SmolLM2 sample's main through onnxruntime's quantize_dynamic
(int8 weights per column, activations quantized at run time, as optimum's dynamic configs
and many hub repositories' `model_quantized.onnx` are), compiled with the sample's int4 draft.

    python samples/smollm2.py       # the sample pair, first
    python samples/int8_sample.py   # build/smollm2-q8/main.onnx, build/smollm2-q8.dsmodel

`dsc compile` makes its per-tensor quantization per token (compiler/passes/token_quant.py);
docs/models.md and docs/performance.md give what it measured.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sample", type=Path, default=Path("build/smollm2"))
    p.add_argument("--out", type=Path, default=Path("build/smollm2-q8"))
    p.add_argument("--bundle", type=Path, default=Path("build/smollm2-q8.dsmodel"))
    args = p.parse_args()
    main_onnx = args.sample / "main.onnx"
    if not main_onnx.exists():
        sys.exit(f"error: {main_onnx}: no such file (run samples/smollm2.py first)")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (args.sample / name).exists():
            shutil.copy(args.sample / name, args.out / name)
    tmp = args.out / "main.tmp.onnx"
    quantize_dynamic(main_onnx, tmp, weight_type=QuantType.QInt8, per_channel=True)
    tmp.rename(args.out / "main.onnx")
    dsc = Path(sys.executable).parent / "dsc"
    subprocess.run([str(dsc), "compile", str(args.out / "main.onnx"),
                    str(args.sample / "draft.onnx"), "-o", str(args.bundle), "--force"],
                   check=True)


if __name__ == "__main__":
    main()
