"""Prometheus text expositions of many replicas -> one exposition.

Each replica renders its registry with its own `replica` label; concatenating the texts
would repeat every `# HELP` / `# TYPE` line, which a Prometheus scrape rejects. Instead each
metric family keeps its header lines once and gathers the samples of every replica:

    # HELP dflash_requests ...        # HELP dflash_requests ...
    # TYPE dflash_requests counter    # TYPE dflash_requests counter
    dflash_requests{replica="a"} 3    dflash_requests{replica="a"} 3
    ...            (replica b)   ->   dflash_requests{replica="b"} 5
"""

from __future__ import annotations

from collections.abc import Iterable


def merge(texts: Iterable[str]) -> str:
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for text in texts:
        family = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split(" ", 3)[2]
                if family not in headers:
                    headers[family], samples[family] = [], []
                if line not in headers[family] and len(headers[family]) < 2:
                    headers[family].append(line)
            elif line.startswith("#"):
                continue
            elif family is not None:
                samples[family].append(line)
    out = [line for family in headers for line in (*headers[family], *samples[family])]
    return "\n".join(out) + "\n" if out else ""
