"""tools/gpu_check.py, the one-command GPU proof, kept working between leases: its
no-CUDA line, its interpreter run (the GPU run's steps 3 and 5 on the CPU, a tiny case of
step 4), and that its lossless check fails on a wrong attention."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from script_runner import run_script

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_script("tools/gpu_check.py", *args, capture_output=True, text=True,
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
    # bench/bench_kernels.py's set-up at a tiny size: the kernel it times matches the SDPA
    # baseline it is compared with
    assert summary["bench"]["max_abs_err"] < 3e-3
    assert summary["bench"]["bytes"] == 2 * 2 * 2 * 40 * 16 * 2 + 2 * 6 * 4 * 16 * 2
    windows = summary["lossless"]["windows"]
    assert summary["lossless"]["passed"] and all(w["same"] for w in windows)
    assert any(w["accepted"] < w["drafted"] for w in windows)  # rejections were exercised
    assert (tmp_path / "gpu_check.log").read_text().strip().endswith(
        f"summary in {tmp_path / 'summary.json'}")


def test_lossless_check_catches_a_wrong_attention(tmp_path):
    """The same check with the kernel's q scaled by 1.5 (a wrong softmax scale) must fail."""
    r = _run("--interpret", "--wrong-scale", "1.5", "--out", str(tmp_path))
    assert r.returncode == 1, r.stdout + r.stderr
    lossless = json.loads((tmp_path / "summary.json").read_text())["lossless"]
    assert not lossless["passed"] and not all(w["same"] for w in lossless["windows"])
