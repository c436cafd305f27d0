"""`dsc inspect`: what a bundle holds, for people (text) and for scripts (--json)."""

from __future__ import annotations

from dspark.runtime.bundle.bundle import Bundle
from dspark.runtime.bundle.spec import ModelSpec
from dspark.runtime.cache.layout import plan_layout


def inspect_dict(bundle: Bundle) -> dict:
    return {
        "bundle": str(bundle.root),
        "format_version": bundle.manifest.format_version,
        "compiler": bundle.manifest.compiler,
        "inputs": bundle.manifest.inputs,
        "flags": bundle.manifest.flags,
        "models": {r: _model_summary(bundle.models[r]) for r in sorted(
            bundle.models, key=lambda r: (r != "main", r != "draft", r))},
        "memory_plan": bundle.plan.to_dict(),
        "config": bundle.config.to_dict(),
        "kernels": bundle.manifest.kernels,
        "stage1": bundle.manifest.stage1,
        "tokenizer": list(bundle.manifest.tokenizer),
        "files": len(bundle.manifest.files),
        "bytes": bundle.manifest.total_bytes,
    }


def _model_summary(s: ModelSpec) -> dict:
    return {
        "layers": s.num_layers, "heads": s.num_heads, "kv_heads": s.num_kv_heads,
        "head_dim": s.head_dim, "vocab_size": s.vocab_size, "kv_dtype": s.kv_dtype,
        "kv_bytes_per_token": s.kv_bytes_per_token, "inputs": list(s.inputs),
        "segments": len(s.segments), "verify_ops": len(s.verify_ops),
        "windows": list(s.windows), "max_positions": s.max_positions,
    }


def spans_text(windows: list[int]) -> str:
    """Attention spans by layer, runs merged: 'layers 0-4 window 512, 5 full'."""
    runs: list[list[int]] = []  # [first layer, last layer, window]
    for layer, w in enumerate(windows):
        if runs and runs[-1][2] == w and runs[-1][1] == layer - 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer, w])
    parts = [(f"{a}" if a == b else f"{a}-{b}") + (f" window {w}" if w else " full")
             for a, b, w in runs]
    return "attention: layers " + ", ".join(parts)


def inspect_text(bundle: Bundle) -> str:
    d = inspect_dict(bundle)
    plan, cfg = bundle.plan, bundle.config
    lines = [f"bundle {d['bundle']}  (format {d['format_version']}, "
             f"dsc {d['compiler']['version']}, {d['files']} files, {d['bytes'] / 2**20:.1f} MiB)"]
    for role, m in d["models"].items():
        src = d["inputs"][role]
        lines.append(
            f"  {role:<5} {m['layers']} layers, {m['heads']} heads / {m['kv_heads']} kv heads x "
            f"{m['head_dim']}, vocab {m['vocab_size']}, {m['kv_dtype']}, {m['segments']} segments, "
            f"{m['verify_ops']} SpeculativeVerify, "
            f"{m['kv_bytes_per_token'] / 1024:.1f} KiB KV/token"
            f"  <- {src['file']} sha256 {src['sha256'][:12]}"
        )
        lines.append(f"        {spans_text(m['windows'])}, proven to {m['max_positions']} "
                     "positions")
        lines.extend(_stage1_lines(d["stage1"].get(role)))
    layout = plan_layout(plan, list(bundle.models.values()))
    groups = ", ".join(f"{g.name} {g.num_blocks} blocks ({len(g.layers)} layers)"
                       for g in layout.groups)
    lines.append(
        f"  memory plan: {plan.layout}, block {plan.block_size} tokens, max_seq_len "
        f"{plan.max_seq_len}; at the bundle's default {plan.budget_bytes / 2**20:.0f} MiB: "
        f"{groups}, {layout.max_seqs} full-length sequences (dsrun sizes the arena at start: "
        "--kv-cache-memory, by default twice --max-batch such sequences within 40% of the "
        "memory available)"
    )
    lines.append(f"  config: window policy {cfg.window.policy} (initial {cfg.window.initial}, "
                 f"max {cfg.window.max_window}), tenants {[t.name for t in cfg.tenants]}")
    k = d["kernels"]
    lines.append(f"  kernels: {k.get('mode', 'none')}" + (
        f", cubin for {', '.join(k['archs'])} (triton {k.get('triton')})" if k.get("archs")
        else f" ({k.get('reason')})" if k.get("reason") else ""))
    lines.append("  tokenizer: " + (", ".join(d["tokenizer"]) or "none (use --prompt-ids)"))
    return "\n".join(lines)


def _stage1_lines(report: dict | None) -> list[str]:
    """Op histogram before -> after stage 1 (ops that changed, most first) and pass counts."""
    if not report:
        return []
    before, after = report["ops_before"], report["ops_after"]
    delta = {op: after.get(op, 0) - before.get(op, 0) for op in {*before, *after}}
    changed = sorted((op for op, d in delta.items() if d), key=lambda op: (-abs(delta[op]), op))
    passes = ", ".join(f"{k} {v}" for k, v in report["passes"].items())
    return [f"        stage 1: {sum(before.values())} -> {sum(after.values())} ops ({passes})",
            "        " + ", ".join(f"{op} {before.get(op, 0)}->{after.get(op, 0)}"
                                   for op in changed)]
