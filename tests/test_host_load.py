"""The other processes' CPU use the engine reports (runtime/host_load.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark.runtime.host_load import HostLoad, thread_hint

SELF_STAT = "1234 (python3 (x)) R 1 2 3 4 5 6 7 8 9 10 {utime} {stime} 0 0 20 0 3 0 99\n"


def _proc(folder: Path, busy: tuple[int, ...], utime: int, stime: int) -> None:
    user, nice, system, irq, softirq, steal = busy
    (folder / "self").mkdir(parents=True, exist_ok=True)
    (folder / "stat").write_text(f"cpu  {user} {nice} {system} 5000 7 {irq} {softirq} {steal} "
                                 "0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    (folder / "self" / "stat").write_text(SELF_STAT.format(utime=utime, stime=stime))


def test_other_cores_are_all_busy_time_less_this_process(tmp_path):
    now = [10.0]
    load = HostLoad(tmp_path, clock=lambda: now[0])
    load.tick = 100
    _proc(tmp_path, (100, 0, 50, 0, 0, 0), utime=40, stime=10)
    assert load.sample() is None  # nothing to compare with yet
    # 2 s later: +300 busy ticks (user, system, irq, softirq and steal all count; idle and
    # iowait do not), of which this process used 100: 200 ticks = 2 s over 2 s = 1 core
    _proc(tmp_path, (250, 10, 90, 40, 20, 40), utime=120, stime=30)
    now[0] = 12.0
    assert load.sample() == pytest.approx(1.0)
    now[0] = 13.0  # no other work since: 0, never negative
    _proc(tmp_path, (300, 10, 90, 40, 20, 40), utime=170, stime=30)
    assert load.sample() == 0.0


def test_a_span_too_short_for_ticks_waits_for_a_longer_one(tmp_path):
    now = [10.0]
    load = HostLoad(tmp_path, clock=lambda: now[0])
    load.tick = 100
    _proc(tmp_path, (100, 0, 50, 0, 0, 0), utime=40, stime=10)
    load.sample()
    now[0] = 10.05
    assert load.sample() is None  # 50 ms: not yet
    _proc(tmp_path, (150, 0, 50, 0, 0, 0), utime=40, stime=10)
    now[0] = 10.5  # measured from the first sample, not the short one
    assert load.sample() == pytest.approx(1.0)


def test_no_proc_no_reading(tmp_path):
    load = HostLoad(tmp_path / "missing")
    assert load.sample() is None and load.sample() is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux /proc")
def test_a_spinning_process_shows_as_a_busy_core():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        load = HostLoad()
        time.sleep(0.3)
        load.sample()
        time.sleep(1.0)
        other = load.sample()
    finally:
        spinner.kill()
        spinner.wait()
    assert other is not None and other >= 0.5


def test_the_thread_hint_names_the_free_cores():
    hint = thread_hint(1.0, threads=2, cores=2)
    assert hint is not None and "DSPARK_THREADS=1" in hint and "1.0 of 2 cores" in hint
    assert "DSPARK_THREADS=6" in thread_hint(1.8, threads=8, cores=8)
    assert thread_hint(0.3, threads=2, cores=2) is None  # too little to matter
    assert thread_hint(1.0, threads=1, cores=2) is None  # already at the free cores
    assert thread_hint(None, threads=2, cores=2) is None


def test_a_warm_up_beside_a_busy_core_names_fewer_threads(tok_bundle, caplog, monkeypatch):
    """The engine's warm-up reports the other processes' load and, with a thread per core
    and one of them taken, logs the thread count that runs faster (the reading itself is the
    spinner test's; a tiny model's warm-up is shorter than /proc's ticks can measure)."""
    from dspark.runtime.engine import warmup as engine_module
    from dspark.runtime.engine.loader import load_engine

    class OneCoreBusy:
        def sample(self):
            return 1.0

    monkeypatch.setenv("DSPARK_THREADS", "2")
    monkeypatch.setattr(engine_module.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(engine_module, "HostLoad", OneCoreBusy)
    engine, _ = load_engine(tok_bundle, warmup=False)
    with caplog.at_level(logging.WARNING, logger="dspark.runtime"):
        result = engine.warmup()
    assert result["other_cores"] == 1.0 and result["main_ms"]
    [hint] = [r.getMessage() for r in caplog.records if "DSPARK_THREADS" in r.getMessage()]
    assert "DSPARK_THREADS=1" in hint and "1.0 of 2 cores" in hint
    monkeypatch.setenv("DSPARK_THREADS", "1")  # already at the free cores: quiet
    caplog.clear()
    engine.warmup()
    assert not [r for r in caplog.records if "DSPARK_THREADS" in r.getMessage()]


@pytest.mark.skipif(not Path("/proc/stat").exists() or (os.cpu_count() or 1) < 2,
                    reason="needs Linux /proc and two cores")
def test_threads_auto_leaves_a_busy_core_out(monkeypatch):
    from dspark.runtime import env

    monkeypatch.setenv("DSPARK_THREADS", "auto")
    env._free_cores.cache_clear()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        threads = env.read_env().threads
    finally:
        spinner.kill()
        spinner.wait()
        env._free_cores.cache_clear()
    assert threads == (os.cpu_count() or 1) - 1


def test_threads_must_be_a_count_auto_or_adaptive(monkeypatch):
    from dspark.runtime import env
    from dspark.runtime.errors import DSparkError

    for bad, why in (("two", "an integer, auto or adaptive"), ("0", ">= 1")):
        monkeypatch.setenv("DSPARK_THREADS", bad)
        with pytest.raises(DSparkError, match=why):
            env.read_env()
    monkeypatch.setenv("DSPARK_THREADS", "3")
    assert env.read_env().threads == 3


def test_metrics_read_the_host_every_few_seconds_not_every_step(tmp_path):
    from dspark.runtime.server.metrics import HOST_EVERY, Metrics

    metrics = Metrics("m", "cpu")
    now = [10.0]
    metrics.host = HostLoad(tmp_path, clock=lambda: now[0])
    metrics.host.tick = 100
    reads = []
    read = metrics.host._read
    metrics.host._read = lambda: reads.append(now[0]) or read()
    _proc(tmp_path, (100, 0, 50, 0, 0, 0), utime=40, stime=10)
    metrics.host.sample()
    now[0] = 10.1  # too short a span: read again at the next step
    metrics._host(now[0])
    now[0] = 11.0
    _proc(tmp_path, (200, 0, 50, 0, 0, 0), utime=40, stime=10)
    metrics._host(now[0])
    assert "dspar_host_other_cores" in metrics.render().decode()
    for t in (11.5, 12.0, 11.0 + HOST_EVERY - 0.1):  # then not until HOST_EVERY has passed
        now[0] = t
        metrics._host(t)
    assert len(reads) == 3
    missing = Metrics("m", "cpu")
    missing.host = HostLoad(tmp_path / "none")
    missing._host(50.0)
    missing._host(50.1)  # nothing to read: it waits too, no read per step
    assert missing.host_at == 50.0
