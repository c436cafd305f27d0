"""Run a command and watch its memory: the peak RSS of its whole process tree, sampled.

    python bench/rss_watch.py [--every 0.5] [--timeline] -- dsc compile main.onnx -o x.dsmodel

The command's stderr lines pass through, each prefixed with the tree's RSS at that moment,
so a peak can be matched to the stage that made it. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


def tree_rss(pid: int) -> int:
    """Bytes resident in `pid` and every descendant (0 once it is gone)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


@dataclass
class Watched:
    returncode: int
    seconds: float
    peak_bytes: int
    stderr: list[str] = field(default_factory=list)


def watch(cmd: list[str], every: float = 0.5, echo: bool = False, env=None) -> Watched:
    """Run `cmd` to its end; its stdout is discarded, its stderr kept (and echoed)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    peak, now, lines = 0, [0], []

    def sample() -> None:
        nonlocal peak
        while proc.poll() is None:
            now[0] = tree_rss(proc.pid)
            peak = max(peak, now[0])
            time.sleep(every)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for line in proc.stderr:
        lines.append(line.rstrip("\n"))
        if echo:
            print(f"[{now[0] / 2**30:5.1f} GiB] {lines[-1]}", file=sys.stderr, flush=True)
    proc.wait()
    sampler.join()
    return Watched(proc.returncode, time.perf_counter() - t0, peak, lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    args = p.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("give the command after --")
    got = watch(cmd, args.every, echo=True)
    print(f"exit {got.returncode}, {got.seconds:.1f} s, peak RSS {got.peak_bytes / 2**30:.2f} GiB")
    sys.exit(got.returncode)


if __name__ == "__main__":
    main()
