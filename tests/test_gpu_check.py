"""samples/gpu_check.py, the one-command GPU proof, kept working between leases: its
no-CUDA line, its interpreter run (the GPU run's steps 3 and 5 on the CPU), and that its
lossless check fails on a wrong attention."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "samples" / "gpu_check.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=600, cwd=str(ROOT))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_what_it_would_run_and_exits_0(tmp_path):
    r = _run("--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") == 1 and "no CUDA device" in r.stdout and "bench" in r.stdout
    assert not (tmp_path / "out").exists()


def test_interpreter_run_checks_kernels_and_losslessness(tmp_path):
    r = _run("--interpret", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["kernels"]["failed"] == 0 and summary["kernels"]["cases"] >= 5
    windows = summary["lossless"]["windows"]
    assert summary["lossless"]["passed"] and all(w["same"] for w in windows)
    assert any(w["accepted"] < w["drafted"] for w in windows)  # rejections were exercised
    assert (tmp_path / "gpu_check.log").read_text().strip().endswith(
        f"summary in {tmp_path / 'summary.json'}")


def test_lossless_check_catches_a_wrong_attention(tmp_path):
    sys.path.insert(0, str(ROOT / "samples"))
    import gpu_lossless as gl

    from dspark.kernels.library import KernelLibrary
    from dspark.kernels.spec import KernelSpec

    class Skewed(gl.KernelAttention):  # a kernel bug: the wrong softmax scale
        def __call__(self, layer, q, k, v, start):
            return super().__call__(layer, q * 1.5, k, v, start)

    device = torch.device("cpu")
    model = gl.ToyModel(device)
    prompt = list(range(5, 18))
    target = gl.greedy(model, gl.ReferenceAttention(model, 64, device), prompt, 16)
    library = KernelLibrary(KernelSpec(model.dim, model.heads, model.kv, 16), str(tmp_path),
                            interpret=True)
    good, _, _ = gl.speculative(model, gl.KernelAttention(model, library, 64, device), prompt,
                                16, 4, target)
    bad, _, _ = gl.speculative(model, Skewed(model, library, 64, device), prompt, 16, 4, target)
    assert good == target and bad != target
