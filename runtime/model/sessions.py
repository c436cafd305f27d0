"""onnxruntime session creation with one process-wide thread pool.

Many sessions take turns (31 segments per model, main and draft): with a pool per session
the idle pools spin and steal the cores, many times slower than one shared pool. So every
session here uses the global pool, created once per process before the first session, and
torch, which runs the attention between segments, stays at one thread, and so does numpy's
BLAS (the CPU attention's small matmuls): a multi-threaded OpenBLAS spins against
onnxruntime's pool. If something else created onnxruntime's environment first, sessions
fall back to their own pools with spinning off (the next best setting measured). The
figures: docs/experiments.md, "Figures behind the source's choices".
"""

from __future__ import annotations

import functools
from pathlib import Path

import onnxruntime as ort

from dspark.runtime.env import read_env

_LEVELS = {
    "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


@functools.cache
def init_threads() -> bool:
    """Create the global onnxruntime pool once; False if it could not be created."""
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)
    threadpool_limits(limits=1, user_api="blas")
    if read_env().adaptive:
        return False  # a session without a pool cannot coexist with the global one
    try:
        ort.set_global_thread_pool_sizes(read_env().threads, 1)
    except Exception:  # noqa: BLE001 - environment already created elsewhere in this process
        return False
    return True


# where a session made from a serialized model finds its weights' external files
EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"

def make_session(path: str | Path | bytes, level: str = "all", optimized_path: Path | None = None,
                 config: dict[str, str] | None = None, providers: list | None = None,
                 profile_prefix: str | None = None, custom_ops: Path | None = None,
                 solo: bool = False, prepack: bool = True,
                 initializers: dict | None = None) -> ort.InferenceSession:
    """A session on the shared pool (`level`: none, basic, extended or all graph optimization);
    `path` may also be a serialized model. `providers` default to the CPU's.
    `profile_prefix`: write onnxruntime's per-op profile there (end_profiling() names it).
    `custom_ops`: a shared library of custom ops to register (kernels/cpu_op.py).
    `solo`: no pool at all, every op on the calling thread (load_gate.py).
    `prepack=False`: kernels keep the weights as loaded instead of adding a packed copy
    (the compiler's sessions: one run or a few, on a model that may fill the memory).
    `initializers`: {name: array} used in place of the model's initializers of those names,
    without a copy (the session keeps the arrays alive)."""
    shared = init_threads() and not solo
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = _LEVELS[level]
    if shared:
        so.use_per_session_threads = False
    elif read_env().adaptive and not solo:
        # a pool per model, spinning within a run as the global one does, but stopped at
        # the end of each, so an idle pool never spins against the one running (main and
        # draft take turns; left spinning, a main pass took nearly twice as long)
        so.intra_op_num_threads = read_env().threads
        so.inter_op_num_threads = 1
        so.add_session_config_entry("session.force_spinning_stop", "1")
    else:
        so.intra_op_num_threads = 1 if solo else read_env().threads
        so.inter_op_num_threads = 1
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    if optimized_path is not None:
        so.optimized_model_filepath = str(optimized_path)
    if custom_ops is not None:
        so.register_custom_ops_library(str(custom_ops))
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    values = [ort.OrtValue.ortvalue_from_numpy(a) for a in (initializers or {}).values()]
    if values:
        so.add_external_initializers(list(initializers), values)
    model = path if isinstance(path, bytes) else str(path)
    session = ort.InferenceSession(model, so, providers=providers or ["CPUExecutionProvider"])
    session.dspark_initializers = (initializers, values)  # onnxruntime reads them in place
    return session
