"""Tiny random-init Hugging Face pairs exported to ONNX, built by code and cached.

Each architecture has a main model and a smaller draft (fewer layers, sharing the main's
embeddings and first layers, so the draft often agrees with the main), both exported in the
two forms users produce: classic (eager, opset 17) and dynamo (sdpa, opset 23).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from dspark.compiler.hf_export import export_causal_lm

ARCHS = ("llama", "gpt2")
FORMS = ("classic", "dynamo")
VOCAB = 320
RECIPE = 2  # bump when fixture configs change


def _config(arch: str, layers: int, attn: str):
    if arch == "llama":
        from transformers import LlamaConfig

        # GQA: 4 query heads share 2 KV heads; larger init so logits are decisive (few near-ties)
        return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, initializer_range=0.25,
                           attn_implementation=attn, tie_word_embeddings=False)
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=512,
                      initializer_range=0.25, attn_implementation=attn)


def _model_class(arch: str):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    return LlamaForCausalLM if arch == "llama" else GPT2LMHeadModel


def make_pair(arch: str, attn: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Main (3 layers) and draft (its first layer, same embeddings and head)."""
    torch.manual_seed(1234)
    cls = _model_class(arch)
    main = cls(_config(arch, 3, attn)).eval()
    draft = cls(_config(arch, 1, attn)).eval()
    draft.load_state_dict(main.state_dict(), strict=False)
    return main, draft


def recipe_hash() -> str:
    import transformers

    blob = json.dumps({"recipe": RECIPE, "torch": torch.__version__,
                       "transformers": transformers.__version__,
                       "export": hashlib.sha256(
                           Path(__import__("dspark.compiler.hf_export", fromlist=["x"]).__file__)
                           .read_bytes()).hexdigest()})
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_fixtures(root: Path) -> dict[tuple[str, str], tuple[Path, Path]]:
    """{(arch, form): (main.onnx, draft.onnx)}, exported once per recipe into root."""
    folder = root / f"fixtures-{recipe_hash()}"
    pairs = {}
    for arch in ARCHS:
        for form in FORMS:
            d = folder / f"{arch}-{form}"
            paths = (d / "main.onnx", d / "draft.onnx")
            if not all(p.exists() for p in paths):
                main, draft = make_pair(arch, "eager" if form == "classic" else "sdpa")
                tmp = d.with_suffix(".tmp")
                for model, p in zip((main, draft), paths):
                    export_causal_lm(model, tmp / p.name, form)
                tmp.rename(d)
            pairs[(arch, form)] = paths
    return pairs
