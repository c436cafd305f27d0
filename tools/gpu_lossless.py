"""Kernel-level lossless check: speculative decoding whose verify attention runs on the DSpark
kernels gives the tokens of plain greedy decoding over a reference attention.

Where the engine cannot run on a GPU (no onnxruntime CUDA provider on the machine), this is
the end-to-end proof gpu_check.py runs instead. A small random transformer (torch, fp32) has
two attentions to choose from:

    reference  a contiguous cache per layer, SDPA with the causal window mask
    kernels    a paged arena with shuffled blocks: kv_inject, then verify_attention
Plain greedy decoding over the reference gives the target tokens. Speculative decoding over
the kernels drafts windows of w tokens from a corrupted copy of the target (so some windows
are rejected part way), verifies them in one forward, keeps the longest agreeing prefix plus
the model's own next token, and rolls back by length (rejected slots are simply rewritten
later, as in the runtime). Its tokens must equal the target's, for every window.
`engine_tests`: the engine itself on CUDA (tests/test_gpu.py), where onnxruntime can.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ToyModel:
    """Embedding -> L x (attention + MLP, residual) -> logits; attention is pluggable."""

    def __init__(self, device, vocab=64, hidden=32, heads=4, kv_heads=2, layers=2, seed=0):
        g = torch.Generator().manual_seed(seed)
        w = lambda *s: (torch.randn(*s, generator=g) / s[0] ** 0.5).to(device)  # noqa: E731
        self.heads, self.kv, self.dim = heads, kv_heads, hidden // heads
        self.embed = (torch.randn(vocab, hidden, generator=g)).to(device)
        self.layers = [dict(q=w(hidden, hidden), k=w(hidden, kv_heads * self.dim),
                            v=w(hidden, kv_heads * self.dim), o=w(hidden, hidden),
                            up=w(hidden, 2 * hidden), down=w(2 * hidden, hidden))
                       for _ in range(layers)]
        self.head = w(hidden, vocab)

    def forward(self, tokens: torch.Tensor, start: int, attend) -> torch.Tensor:
        """Logits [T, vocab] for `tokens` at positions start.. ; attend(layer, q, k, v, start)
        with q [T, heads, d], k/v [T, kv, d] returns [T, heads, d]."""
        x = self.embed[tokens]
        for i, p in enumerate(self.layers):
            q = (x @ p["q"]).view(-1, self.heads, self.dim)
            k = (x @ p["k"]).view(-1, self.kv, self.dim)
            v = (x @ p["v"]).view(-1, self.kv, self.dim)
            x = x + attend(i, q, k, v, start).reshape(x.shape) @ p["o"]
            x = x + F.gelu(x @ p["up"]) @ p["down"]
        return x @ self.head


class ReferenceAttention:
    def __init__(self, model: ToyModel, max_len: int, device):
        shape = (model.kv, max_len, model.dim)
        self.k = [torch.zeros(shape, device=device) for _ in model.layers]
        self.v = [torch.zeros(shape, device=device) for _ in model.layers]
        self.scale = model.dim ** -0.5

    def __call__(self, layer, q, k, v, start):
        n = q.shape[0]
        self.k[layer][:, start:start + n] = k.transpose(0, 1)
        self.v[layer][:, start:start + n] = v.transpose(0, 1)
        keys, values = self.k[layer][:, :start + n], self.v[layer][:, :start + n]
        mask = torch.arange(start + n, device=q.device)[None] <= (
            start + torch.arange(n, device=q.device))[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                             attn_mask=mask, scale=self.scale, enable_gqa=True)
        return out[0].transpose(0, 1)


class KernelAttention:
    """One sequence over a paged arena (shuffled blocks), through the DSpark kernels."""

    def __init__(self, model: ToyModel, library, max_len: int, device, splits=None,
                 skew: float = 1.0):
        """`skew`: q scaled by it before the kernel, a wrong softmax scale on purpose (the
        check must then fail: gpu_check.py --wrong-scale)."""
        from dspark.kernels.kv_cache import kv_inject  # noqa: F401 - fail early if missing

        bs = library.spec.block_size
        blocks = -(-max_len // bs) + 3
        shape = (blocks, model.kv, bs, model.dim)
        self.k = [torch.zeros(shape, device=device) for _ in model.layers]
        self.v = [torch.zeros(shape, device=device) for _ in model.layers]
        perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))
        self.table = perm[None].to(device, torch.int32)
        self.library, self.bs, self.splits, self.skew = library, bs, splits, skew
        self.scale = model.dim ** -0.5

    def __call__(self, layer, q, k, v, start):
        from dspark.kernels.kv_cache import kv_inject
        from dspark.kernels.verify_attention import verify_attention

        q = q * self.skew if self.skew != 1.0 else q

        n, dev = q.shape[0], q.device
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
        pos = torch.arange(start, start + n, device=dev)
        kv_inject(k.contiguous(), v.contiguous(), self.k[layer], self.v[layer],
                  self.table[0, pos // self.bs].contiguous(), (pos % self.bs).to(torch.int32),
                  self.library)
        return verify_attention(q.contiguous(), self.k[layer], self.v[layer], self.table,
                                i32([start]), i32([n]), i32([0]), self.scale, self.library,
                                splits=self.splits)


def greedy(model: ToyModel, attend, prompt: list[int], n: int) -> list[int]:
    device = model.embed.device
    logits = model.forward(torch.tensor(prompt, device=device), 0, attend)
    out, pos = [int(logits[-1].argmax())], len(prompt)
    while len(out) < n:
        logits = model.forward(torch.tensor(out[-1:], device=device), pos, attend)
        out.append(int(logits[-1].argmax()))
        pos += 1
    return out


def speculative(model: ToyModel, attend, prompt: list[int], n: int, window: int,
                proposals: list[int]) -> tuple[list[int], int, int]:
    """Greedy speculative decoding with drafts taken from `proposals` (position-aligned with
    the output); returns (tokens, drafted, accepted)."""
    device = model.embed.device
    logits = model.forward(torch.tensor(prompt, device=device), 0, attend)
    out, pos, drafted, accepted = [int(logits[-1].argmax())], len(prompt), 0, 0
    while len(out) < n:
        drafts = proposals[len(out):len(out) + min(window, n - len(out) - 1)]
        logits = model.forward(torch.tensor(out[-1:] + drafts, device=device), pos, attend)
        best = logits.argmax(-1).tolist()
        keep = 0
        while keep < len(drafts) and drafts[keep] == best[keep]:
            keep += 1
        out += drafts[:keep] + [best[keep]]
        pos += 1 + keep  # rejected slots stay in the arena and are overwritten later
        drafted, accepted = drafted + len(drafts), accepted + keep
    return out[:n], drafted, accepted


def check(device, library_for, windows=(1, 4, 8), new_tokens=40, prompt_len=13,
          splits=None, skew: float = 1.0) -> dict:
    """Run the check; `library_for(spec)` gives the KernelLibrary (JIT on a GPU, the
    interpreter on the CPU); `skew`: KernelAttention's, a wrong attention on purpose."""
    from dspark.kernels.spec import KernelSpec

    model = ToyModel(device)
    max_len = prompt_len + new_tokens + max(windows) + 1
    prompt = torch.randint(0, 64, (prompt_len,), generator=torch.Generator().manual_seed(2))
    prompt = prompt.tolist()
    target = greedy(model, ReferenceAttention(model, max_len, device), prompt, new_tokens)
    g = torch.Generator().manual_seed(3)
    noisy = [t if float(torch.rand(1, generator=g)) < 0.75 else (t + 1) % 64 for t in target]
    library = library_for(KernelSpec(model.dim, model.heads, model.kv, 16, "float32"))
    rows = []
    for w in windows:
        attend = KernelAttention(model, library, max_len, device, splits, skew)
        got, drafted, accepted = speculative(model, attend, prompt, new_tokens, w, noisy)
        first_diff = next((i for i, (a, b) in enumerate(zip(got, target)) if a != b), None)
        rows.append({"window": w, "same": got == target, "first_difference": first_diff,
                     "drafted": drafted, "accepted": accepted})
    return {"tokens": new_tokens, "windows": rows, "passed": all(r["same"] for r in rows)}


def engine_tests(root) -> str:
    """The engine on CUDA through tests/test_gpu.py, run from the repository `root` (fixture
    bundles compiled on the spot: needs the dev extra; a missing part shows as the tests'
    own error)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py"],
                       capture_output=True, text=True, timeout=300, cwd=str(root))
    tail = (r.stdout.strip().splitlines() or ["no output"])[-1]
    return f"pytest -m gpu tests/test_gpu.py: exit {r.returncode}: {tail}"
