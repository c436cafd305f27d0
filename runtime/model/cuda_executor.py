"""A compiled model on the GPU: onnxruntime CUDA execution provider sessions for the
segments, the DSpark kernels between them, everything on torch's current stream.

    input_ids, position_ids, logits_index (torch, device)
      -> segment 0 (IOBinding: inputs bound to device memory, outputs left on the device)
      -> q0 k0 v0 (OrtValues, viewed as torch tensors without a copy)
      -> KernelAttention(layer 0): kv_inject into the device arena, verify_attention -> out0
      -> segment 1 (out0 bound as its input) ... -> logits: only the chosen rows come back
Segments run on the stream the kernels use (`user_compute_stream`), so nothing waits between
them; the only host copy per forward is the chosen logits.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from dspark.runtime.bundle.bundle import Bundle
from dspark.runtime.bundle.spec import INPUT_IDS, LOGITS, LOGITS_INDEX, POSITION_IDS, VerifyOp
from dspark.runtime.model.batch import FlatBatch
from dspark.runtime.model.kernel_attention import KernelAttention
from dspark.runtime.model.layout import attend_rows
from dspark.runtime.model.sessions import make_session

# onnxruntime element type -> (array-interface type string, torch dtype to view it as)
_ELEMENT = {
    "tensor(float)": ("<f4", None), "tensor(float16)": ("<f2", None),
    "tensor(bfloat16)": ("<i2", torch.bfloat16), "tensor(int64)": ("<i8", None),
    "tensor(int32)": ("<i4", None),
}
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64,
          torch.int32: np.int32, torch.bfloat16: np.uint16}


class _DeviceArray:
    """An OrtValue's device memory as a CUDA array interface, for torch.as_tensor."""

    def __init__(self, value, typestr: str):
        self.__cuda_array_interface__ = {
            "shape": tuple(value.shape()), "typestr": typestr,
            "data": (value.data_ptr(), False), "version": 2, "strides": None}


def as_torch(value, device: torch.device) -> torch.Tensor:
    """A torch view of an onnxruntime output on the device (the OrtValue must outlive it)."""
    typestr, view = _ELEMENT[value.data_type()]
    tensor = torch.as_tensor(_DeviceArray(value, typestr), device=device)
    return tensor.view(view) if view is not None else tensor


class CudaSegmentedModel:
    def __init__(self, bundle: Bundle, role: str, attention: KernelAttention,
                 device: torch.device):
        self.spec = bundle.model(role)
        self.attention = attention
        self.device = device
        self.device_id = device.index or 0
        stream = torch.cuda.current_stream(device).cuda_stream
        providers = [("CUDAExecutionProvider", {"device_id": self.device_id,
                                                "user_compute_stream": str(stream)}),
                     "CPUExecutionProvider"]
        self.sessions = [make_session(bundle.path(s.file), providers=providers)
                         for s in self.spec.segments]
        ops_after: dict[int, list[VerifyOp]] = defaultdict(list)
        for op in self.spec.verify_ops:
            ops_after[op.after_segment].append(op)
        self.steps = [(sess, list(seg.outputs), list(seg.inputs), ops_after[seg.index])
                      for seg, sess in zip(self.spec.segments, self.sessions)]
        self.int_types = {i.name: torch.int32 if i.type == "tensor(int32)" else torch.int64
                          for s in self.sessions for i in s.get_inputs()
                          if i.name in (INPUT_IDS, POSITION_IDS, LOGITS_INDEX)}

    def _ids(self, name: str, values: np.ndarray) -> torch.Tensor:
        dtype = self.int_types.get(name, torch.int64)
        return torch.from_numpy(np.ascontiguousarray(values)).to(self.device, dtype)

    def _bind(self, io, name: str, value) -> None:
        if isinstance(value, torch.Tensor):
            value = value.contiguous()
            io.bind_input(name, "cuda", self.device_id, _NUMPY[value.dtype],
                          tuple(value.shape), value.data_ptr())
        else:
            io.bind_ortvalue_input(name, value)

    def forward(self, batch: FlatBatch, rows: np.ndarray | None = None) -> np.ndarray:
        """Logits [len(rows), vocab] on the host for the chosen rows (default: all)."""
        env: dict[str, object] = {
            INPUT_IDS: self._ids(INPUT_IDS, batch.token_ids[None]),
            POSITION_IDS: self._ids(POSITION_IDS, batch.positions[None]),
        }
        selects = LOGITS_INDEX in self.spec.inputs
        if selects:
            index = np.arange(batch.num_tokens) if rows is None else rows
            env[LOGITS_INDEX] = self._ids(LOGITS_INDEX, index)
        for sess, outputs, inputs, ops in self.steps:
            io = sess.io_binding()
            for name in inputs:
                self._bind(io, name, env[name])
            for name in outputs:
                io.bind_output(name, "cuda", self.device_id)
            sess.run_with_iobinding(io)
            env.update(zip(outputs, io.get_outputs()))  # kept alive until the forward ends
            for op in ops:
                q, k, v = (as_torch(env[n], self.device) for n in (op.q, op.k, op.v))
                env[op.out] = attend_rows(self.attention, op, q, k, v, batch)
        logits = as_torch(env[LOGITS], self.device)[0]
        if rows is not None and not selects:
            logits = logits[torch.from_numpy(np.asarray(rows)).to(self.device)]
        return logits.float().cpu().numpy()
