"""Export a Hugging Face causal LM to ONNX with KV-cache I/O, the way users' exports look.

    inputs   input_ids [batch, seq], attention_mask [batch, past+seq],
             past_key_values.{i}.key|value [batch, kv_heads, past, head_dim]
    outputs  logits [batch, seq, vocab], present.{i}.key|value
Three forms: "classic" (eager attention, torch.onnx dynamo=False, opset 17:
MatMul-Softmax-MatMul), "sdpa" (what optimum-cli writes: sdpa attention, dynamo=False, opset
18: q and k each scaled by sqrt(scale), a NaN guard after the Softmax) and "dynamo" (sdpa,
dynamo=True, opset 23: standard ONNX Attention nodes). The model's attention implementation
must match (eager for classic, sdpa otherwise). A mixture-of-experts model is exported with
its experts as batched matmuls. Used by the samples and the test fixtures;
needs the dev extra (transformers, onnxscript).
"""

from __future__ import annotations

from pathlib import Path

import torch


class _WithPast(torch.nn.Module):
    """Flat tensors in and out, so the exporter names them like optimum does."""

    def __init__(self, model: torch.nn.Module, num_layers: int):
        super().__init__()
        self.model, self.num_layers = model, num_layers

    def forward(self, input_ids, attention_mask, *past):
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache()
        for i in range(self.num_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         past_key_values=cache, use_cache=True)
        flat = [out.logits]
        for layer in out.past_key_values.layers:
            flat += [layer.keys, layer.values]
        return tuple(flat)


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    kinds = ("key", "value")
    inputs = ["input_ids", "attention_mask"] + [
        f"past_key_values.{i}.{k}" for i in range(num_layers) for k in kinds]
    outputs = ["logits"] + [f"present.{i}.{k}" for i in range(num_layers) for k in kinds]
    return inputs, outputs


def kv_geometry(config) -> tuple[int, int, int]:
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers, kv_heads, head_dim


def export_causal_lm(model: torch.nn.Module, path: Path, form: str) -> Path:
    """Write `model` (eval mode, attention implementation matching `form`) to `path`."""
    layers, kv_heads, head_dim = kv_geometry(model.config)
    for module in model.modules():
        if hasattr(module, "_is_expert_parallel"):  # transformers' mixture-of-experts layers
            # The eager experts loop over the experts the trace's tokens hit (the classic
            # exporter would bake that routing in) and grouped_mm needs histc, which no
            # opset has; batched_mm gathers each token's experts' weights, the routing all
            # tensor ops.
            module.config._experts_implementation = "batched_mm"
    wrapper = _WithPast(model.eval(), layers)
    batch, new, past = 1, 3, 4
    ids = torch.randint(0, model.config.vocab_size, (batch, new))
    mask = torch.ones(batch, past + new, dtype=torch.int64)
    cache = [torch.randn(batch, kv_heads, past, head_dim) for _ in range(2 * layers)]
    inputs, outputs = io_names(layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        if form in CLASSIC_OPSETS:
            _export_classic(wrapper, (ids, mask, *cache), path, inputs, outputs,
                            CLASSIC_OPSETS[form])
        elif form == "dynamo":
            _export_dynamo(wrapper, (ids, mask, *cache), path, inputs, outputs, layers)
        else:
            raise ValueError(f"form must be 'classic', 'sdpa' or 'dynamo', got {form!r}")
    return path


CLASSIC_OPSETS = {"classic": 17, "sdpa": 18}  # the torchscript exporter's forms


def _export_classic(wrapper, args, path, inputs, outputs, opset: int) -> None:
    axes = {"input_ids": {0: "batch", 1: "sequence"},
            "attention_mask": {0: "batch", 1: "total_sequence"},
            "logits": {0: "batch", 1: "sequence"}}
    axes.update({n: {0: "batch", 2: "past_sequence"} for n in inputs[2:]})
    axes.update({n: {0: "batch", 2: "total_sequence"} for n in outputs[1:]})
    torch.onnx.export(wrapper, args, str(path), input_names=inputs, output_names=outputs,
                      dynamic_axes=axes, opset_version=opset, dynamo=False)


def _export_dynamo(wrapper, args, path, inputs, outputs, layers) -> None:
    from torch.export import Dim

    batch, seq = Dim("batch", max=256), Dim("sequence", max=8192)
    past, total = Dim("past_sequence", max=8192), Dim("total_sequence", max=16384)
    shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: total},
              "past": tuple({0: batch, 2: past} for _ in range(2 * layers))}
    program = torch.onnx.export(wrapper, args, dynamo=True, opset_version=23,
                                dynamic_shapes=shapes, input_names=inputs, output_names=outputs)
    program.save(str(path))
