"""Would a draft cut from the main itself pay? Early exit, skipped layers, fewer bits.

    python tools/self_draft_probe.py [--model build/peers/hf] [--max-tokens 128]

A self-speculative draft (early exit from the main's own layers, the main with some
layers skipped, or its layers' weights at fewer bits, no training) needs no second model,
which is what an int4 main lacks: its only smaller sibling is itself at fewer bits. This
probe measures what such drafts would hold. The fewer-bit drafts round every projection of
the layers to 2 or 3 bits per weight, blocks of 32 with a scale and a min (the int4 main's
own layout, Q4_1, at fewer levels), the head as it is. The main (the Hugging Face folder
`bench_peers.py --setup` writes: the sample's fp32 weights) decodes the peer prompts
greedily; then, teacher-forced on those outputs, each candidate draft's top-1 is compared
with the main's at every generated position. That share is the draft's per-token
acceptance a.

The printed bound is generous to the draft: its cost is taken as kept / all layers of a
main step (its own head and per-node overhead left out), or bits / 4 of an int4 main's
step (as if a step were all weight bytes, its head at fewer bits too), and a verify as one
main step, so a window of g yields (1 - a^(g+1)) / (1 - a) tokens for g * cost + 1 steps.
A draft whose bound stays under 1 cannot pay on any window.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PROMPTS = Path(__file__).resolve().parents[1] / "samples" / "prompts" / "peer_prompts.jsonl"


def bound(accept: float, cost: float, windows: range = range(1, 9)) -> float:
    """The best tokens per main step over windows, against plain decoding's 1."""
    if accept >= 1.0:
        return max((g + 1) / (g * cost + 1) for g in windows)
    return max((1 - accept ** (g + 1)) / (1 - accept) / (g * cost + 1) for g in windows)


def candidates(layers: int) -> dict[str, list[int]]:
    """Early exits (the last layers dropped) and skips spread over the middle."""
    exits = {f"exit after {k}": list(range(k, layers)) for k in (layers - 2, layers - 4,
                                                                  layers - 6, layers // 2)}
    spread = {f"skip {n} of the middle": list(range(3, layers - 2, (layers - 5) // n))[:n]
              for n in (2, 4, 6)}
    return {**exits, **spread}


def round_bits(w, bits: int, block: int = 32):
    """w [out, in] on a `bits`-bit grid per block of `block` inputs: (w - min) / scale
    rounded to 0 .. 2^bits - 1, scale = (max - min) / (2^bits - 1), then back."""
    rows, cols = w.shape
    b = w.reshape(rows, cols // block, block)
    lo = b.min(-1, keepdim=True).values
    scale = (b.max(-1, keepdim=True).values - lo).clamp_min(1e-12) / (2 ** bits - 1)
    return ((b - lo) / scale).round().mul(scale).add(lo).reshape(rows, cols)


def at_bits(layers, bits: int) -> list:
    """Round every Linear of the layers to `bits` bits; returns their weights to restore."""
    import torch

    saved = []
    for module in layers.modules():
        if isinstance(module, torch.nn.Linear):
            saved.append((module, module.weight.data))
            module.weight.data = round_bits(module.weight.data, bits)
    return saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("build/peers/hf"))
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    layers = model.model.layers
    runs = []
    with torch.no_grad():
        for line in PROMPTS.read_text().splitlines():
            prompt = json.loads(line)
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt["chat"]}], add_generation_prompt=True,
                return_tensors="pt", return_dict=True)["input_ids"]
            out = model.generate(ids, max_new_tokens=args.max_tokens, do_sample=False)
            n = ids.shape[1]
            top1 = model(out, use_cache=False).logits[0, n - 1:-1].argmax(-1)
            runs.append((prompt["class"], out, n, top1))
        print(f"{args.model}: {len(layers)} layers, {sum(len(r[3]) for r in runs)} tokens")
        for name, dropped in candidates(len(layers)).items():
            model.model.layers = torch.nn.ModuleList(
                layer for i, layer in enumerate(layers) if i not in dropped)
            report(name, (len(layers) - len(dropped)) / len(layers), held(model, runs))
            model.model.layers = layers
        for bits in (3, 2):
            saved = at_bits(layers, bits)
            report(f"layers at {bits} bits", bits / 4, held(model, runs))
            for module, weight in saved:
                module.weight.data = weight


def held(model, runs) -> dict[str, float]:
    """Per class, the share of generated positions where the model's top-1 is the main's."""
    counts: dict[str, list[int]] = {}
    for cls, out, n, top1 in runs:
        draft = model(out, use_cache=False).logits[0, n - 1:-1].argmax(-1)
        h = counts.setdefault(cls, [0, 0])
        h[0] += int((draft == top1).sum())
        h[1] += len(top1)
    return {cls: a / t for cls, (a, t) in counts.items()}


def report(name: str, cost: float, shares: dict[str, float]) -> None:
    print(f"{name:24s} cost >= {cost:.2f}  " + "  ".join(
        f"{cls} a={a:.2f} bound {bound(a, cost):.2f}x" for cls, a in shares.items()))


if __name__ == "__main__":
    main()
