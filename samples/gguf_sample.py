"""A real pretrained model from a GGUF on PyPI as a DSpark sample: main + draft ONNX.

    main.onnx    fp32 (the GGUF dequantized by transformers), eager attention, classic
                 torch.onnx export with KV-cache I/O
    draft.onnx   the main quantized by `dsc quantize` (compiler/quantize.py): 4-bit
                 projections with a min per block, an 8-bit head
    tokenizer.json, tokenizer_config.json
Cached in the output folder by a stamp of the recipe and the GGUF: a second run with the
same inputs does nothing. samples/smollm2.py and samples/gemma3.py name their GGUF.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from pathlib import Path

OUTPUTS = ("main.onnx", "draft.onnx", "tokenizer.json", "tokenizer_config.json")


def stamp(gguf: Path, recipe: int, script: Path) -> str:
    st = gguf.stat()
    return json.dumps({"recipe": recipe, "gguf": gguf.name, "size": st.st_size,
                       "script": hashlib.sha256(script.read_bytes()).hexdigest(),
                       "helper": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()})


def up_to_date(out: Path, want: str, outputs: tuple[str, ...], tag: str) -> bool:
    """Whether `out` holds `outputs` made under the stamp `want`; if not, the folder is
    made and its stamp removed (written again once the outputs are)."""
    stamp_file = out / "STAMP"
    if stamp_file.exists() and stamp_file.read_text() == want and all(
            (out / f).exists() for f in outputs):
        print(f"[{tag}] {out}: up to date")
        return True
    out.mkdir(parents=True, exist_ok=True)
    stamp_file.unlink(missing_ok=True)
    return False


def load_model(gguf: Path):
    """transformers loads GGUF (dequantized to fp32) into its plain model class, eager."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf.name, "dtype": torch.float32}
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent),
                                                     attn_implementation="eager", **kw)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model.eval(), tokenizer


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses the GGUF's header once for the config, the weights and the
    tokenizer each, and builds gguf's tensor-name map again for every tensor: the same
    values every time, and SmolLM2's load took 38 s so, 12 s with each made once (the
    weights equal, bit for bit). Both memoized while loading, put back after."""
    import functools

    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    reader = functools.cache(saved[0])
    gguf.GGUFReader = lambda path, *a, **k: reader(str(path), *a, **k)
    gguf.get_tensor_name_map = functools.cache(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def build(out: Path, gguf: Path, recipe: int, script: Path) -> None:
    """Export, quantize and save the tokenizer of `gguf` into `out` (unless up to date)."""
    from dspark.compiler.hf_export import export_causal_lm
    from dspark.compiler.quantize import quantize_file

    want = stamp(gguf, recipe, script)
    if up_to_date(out, want, OUTPUTS, "sample"):
        return
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
    (out / "STAMP").write_text(want)
    print(f"[sample] {out} ready in {time.perf_counter() - t0:.0f}s")
