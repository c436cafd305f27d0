"""The line every benchmark report starts with: the CPU, its ISA flags, and what the
environment forced in place of the CPU's best."""

from __future__ import annotations

import platform

from dspark.runtime.model.device import ISA_FLAGS, cpu_line


def test_it_names_the_cpu_and_only_flags_it_knows(monkeypatch):
    monkeypatch.delenv("DSPARK_CPU_ISA", raising=False)
    monkeypatch.delenv("DSPARK_CPU_MARCH", raising=False)
    line = cpu_line()
    assert line.startswith("CPU ") and f"({platform.machine()})" in line
    flags = line.split("flags ", 1)[1]
    assert "forced" not in line and "-march" not in line
    assert flags.startswith("none of ") or set(flags.split()) <= set(ISA_FLAGS)


def test_a_forced_path_and_march_are_said(monkeypatch):
    monkeypatch.setenv("DSPARK_CPU_ISA", "avx2")
    monkeypatch.setenv("DSPARK_CPU_MARCH", "haswell")
    line = cpu_line()
    assert line.endswith("; dsrun's MatMulInt4 forced to its avx2 path; "
                         "its attention built for -march=haswell")
