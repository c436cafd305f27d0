"""Would trained draft heads pay for an int4 main? Medusa heads on the main's last hidden state.

    python tools/trained_heads_probe.py [--model build/peers/hf] [--max-tokens 384]
                                          [--vocab 8192] [--epochs 30]

self_draft_probe.py found that no draft cut from SmolLM2 itself pays untrained. Medusa-style
heads are the cheapest trained draft: head k reads the main's final hidden state at position
t (after its norm) through one residual block, h + SiLU(W h + b), and predicts the main's token
at t + 1 + k with the main's own (tied) head restricted to the `--vocab` most frequent tokens
of the training outputs. Their drafts come out of the forward that verifies, so they cost no
draft forward: the blocks and a `--vocab`-row head, per token of the window.

Training data: the main's greedy answers (HF generate, fp32, the sample's own weights) to the
60 datastore prompts (cached in build/reports/heads_probe_answers_<max-tokens>.pt;
`--train-share` takes the first part of them, for a learning curve); held out: the 12 peer
prompts, whose answers are the test. Per class it
prints each head's top-1 agreement with the main (head 2 counted where head 1 held) and the
bound of a verify that carries the main's next token plus the heads' chain:
(1 + a1 + a1 a2) tokens for one forward of 1 + heads tokens priced `--verify-cost` decodes
(1.15 for 2 tokens, 1.25 for 3: `dsrun bench --profile --verify-tokens` on the q4 bundle)
plus the heads' own weight bytes against the q4 main's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PROMPTS = Path(__file__).resolve().parents[1] / "samples" / "prompts"


def answers(model, tokenizer, file: Path, max_tokens: int, batch: int = 6):
    """(class, ids [n + m], n) for each prompt: its chat prompt and the main's greedy answer."""
    import torch

    prompts = [json.loads(line) for line in file.read_text().splitlines()]
    tokenizer.padding_side = "left"
    out = []
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p["chat"]}],
                                               add_generation_prompt=True, tokenize=False)
                 for p in group]
        enc = tokenizer(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or 0)
        width = enc["input_ids"].shape[1]
        for p, row, mask in zip(group, gen, enc["attention_mask"]):
            start = width - int(mask.sum())
            answer = row[width:]
            stop = (answer == tokenizer.eos_token_id).nonzero()
            end = int(stop[0]) + 1 if len(stop) else len(answer)
            out.append((p["class"], row[start:width + end], width - start))
        print(f"  {min(i + batch, len(prompts))}/{len(prompts)} prompts", flush=True)
    return out


def features(model, runs, heads: int):
    """Teacher-forced: the final hidden state at each answer position t and the main's top-1
    at t, t+1, ..., t+heads (its next token and the heads' targets)."""
    import torch

    xs, ys, classes = [], [], []
    with torch.no_grad():
        for cls, ids, n in runs:
            out = model(ids[None], output_hidden_states=True, use_cache=False)
            top1 = out.logits[0].argmax(-1)
            last = len(ids) - heads - 1
            if last < n - 1:
                continue
            xs.append(out.hidden_states[-1][0, n - 1:last])
            ys.append(torch.stack([top1[n - 1 + k:last + k] for k in range(heads + 1)], -1))
            classes += [cls] * (last - n + 1)
    return torch.cat(xs), torch.cat(ys), classes


class Heads:
    """`count` residual blocks over a frozen, vocabulary-restricted head."""

    def __init__(self, head_weight, keep, count: int, width: int):
        import torch

        self.keep = keep
        self.head = head_weight[keep].clone()  # [V', width]
        self.blocks = [torch.nn.Linear(width, width) for _ in range(count)]
        for b in self.blocks:
            torch.nn.init.zeros_(b.weight)
            torch.nn.init.zeros_(b.bias)

    def logits(self, x, k: int):
        import torch

        h = x + torch.nn.functional.silu(self.blocks[k](x))
        return h @ self.head.T

    def parameters(self):
        return [p for b in self.blocks for p in b.parameters()]


def train(heads: Heads, x, y, index, epochs: int, check, batch: int = 2048) -> None:
    """AdamW on every head's cross entropy; `check()` after every 5th epoch."""
    import torch

    opt = torch.optim.AdamW(heads.parameters(), lr=1e-3, weight_decay=0.01)
    for epoch in range(epochs):
        perm = torch.randperm(len(x))
        total = 0.0
        for i in range(0, len(x), batch):
            sel = perm[i:i + batch]
            loss = 0
            for k in range(len(heads.blocks)):
                target = index[y[sel, k + 1]]
                loss = loss + torch.nn.functional.cross_entropy(
                    heads.logits(x[sel], k), target, ignore_index=-1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(sel)
        if epoch % 5 == 4 or epoch in (0, epochs - 1):
            print(f"  epoch {epoch + 1}: loss {total / len(x):.3f}; held out: {check()}",
                  flush=True)


def agreement(heads: Heads, x, y, classes) -> dict[str, tuple[float, float]]:
    import torch

    with torch.no_grad():
        guess = [heads.keep[heads.logits(x, k).argmax(-1)] for k in range(len(heads.blocks))]
    out = {}
    for cls in sorted(set(classes)):
        m = torch.tensor([c == cls for c in classes])
        a1 = guess[0][m] == y[m, 1]
        a2 = (guess[1][m] == y[m, 2]) & a1
        held = a1.float()
        out[cls] = (float(held.mean()), float(a2.float().sum() / held.sum().clamp_min(1)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("build/peers/hf"))
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--train-share", type=float, default=1.0,
                   help="train on this share of the training prompts (a learning curve)")
    p.add_argument("--verify-cost", type=float, nargs=2, default=(1.15, 1.25))
    args = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    cache = Path("build/reports") / f"heads_probe_answers_{args.max_tokens}.pt"
    if cache.exists():
        train_runs, test_runs = torch.load(cache)
    else:
        print("training answers (datastore prompts):", flush=True)
        train_runs = answers(model, tokenizer, PROMPTS / "datastore_prompts.jsonl",
                             args.max_tokens)
        print("held-out answers (peer prompts):", flush=True)
        test_runs = answers(model, tokenizer, PROMPTS / "peer_prompts.jsonl", 128)
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save((train_runs, test_runs), cache)
    train_runs = train_runs[:max(1, round(len(train_runs) * args.train_share))]
    x, y, _ = features(model, train_runs, 2)
    tx, ty, tclasses = features(model, test_runs, 2)
    counts = torch.bincount(y[:, 1:].reshape(-1), minlength=model.config.vocab_size)
    keep = counts.argsort(descending=True)[:args.vocab]
    index = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    index[keep] = torch.arange(len(keep))
    covered = float((index[ty[:, 1]] >= 0).float().mean())
    print(f"{len(x)} training positions, {len(tx)} held out; the {args.vocab} tokens cover "
          f"{covered:.1%} of the held-out targets", flush=True)
    heads = Heads(model.get_output_embeddings().weight.detach(), keep, 2,
                  model.config.hidden_size)
    train(heads, x, y, index, args.epochs, lambda: {
        cls: round(a[0], 2) for cls, a in agreement(heads, tx, ty, tclasses).items()})
    width, vocab = model.config.hidden_size, model.config.vocab_size
    layer_bytes = sum(p.numel() for n, p in model.named_parameters()
                      if ".layers." in n and p.dim() == 2) / 2 + vocab * width  # 4-bit, 8-bit head
    head_bytes = 2 * (width * width + args.vocab * width)  # 8-bit blocks and rows
    extra = head_bytes / layer_bytes
    print(f"heads' weight bytes at 8 bits: {extra:.1%} of a q4 step's")
    for cls, (a1, a2) in agreement(heads, tx, ty, tclasses).items():
        one = (1 + a1) / (args.verify_cost[0] + extra / 2)
        two = (1 + a1 + a1 * a2) / (args.verify_cost[1] + extra)
        print(f"{cls:5s} head 1 held {a1:.2f}, head 2 where head 1 held {a2:.2f}: "
              f"bound {one:.2f}x with one head, {two:.2f}x with two")
    train_agree = agreement(heads, x[:4000], y[:4000], ["train"] * min(4000, len(x)))
    print("on training positions:", {k: tuple(round(v, 2) for v in a)
                                    for k, a in train_agree.items()})


if __name__ == "__main__":
    main()
