"""A lookup datastore: what the main model itself wrote after each n-gram, over a corpus of
its own greedy outputs (`dsc datastore`, stored in the bundle as `lookup_store.npz`).

    table:  for n in [1, max_n], n-gram -> (the token that followed it most often, that
            count, all continuations' count); built once, read-only while serving
    walk:   at each step take the longest n-token suffix of the context (proposal included)
            that the corpus holds and emit its most frequent continuation; a step's agreement
            is that continuation's share. Retrieval-based speculation (REST) from a corpus of
            the model's own outputs, so its proposals follow the model's habits (phrases,
            list markup, code idioms) in requests whose context has no copy to look up.

The lookup drafter asks it only when the sequence's own context has no match; its proposals
are verified like any other, so they never change output.
"""

from __future__ import annotations

import io
import os
import zipfile
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from dspark.runtime.errors import BundleError

STORE_FILE = "lookup_store.npz"


class Datastore:
    def __init__(self, table: dict[tuple[int, ...], tuple[int, int, int]], max_n: int):
        self.table, self.max_n = table, max_n

    def __len__(self) -> int:
        return len(self.table)

    @classmethod
    def build(cls, streams: Iterable[list[int]], max_n: int = 4) -> Datastore:
        """From token streams (prompt + the model's output): every n-gram's continuations."""
        counts: dict[tuple[int, ...], Counter] = defaultdict(Counter)
        for stream in streams:
            for n in range(1, max_n + 1):
                for i in range(n, len(stream)):
                    counts[tuple(stream[i - n:i])][stream[i]] += 1
        table = {}
        for key, c in counts.items():
            token, count = max(c.items(), key=lambda kv: (kv[1], -kv[0]))  # ties: lowest id
            table[key] = (token, count, sum(c.values()))
        return cls(table, max_n)

    def walk(self, tail: list[int], k: int) -> tuple[int, list[int], list[float]]:
        """(the first step's match length, up to k tokens continuing `tail`, each step's
        agreement); (0, [], []) when no suffix of `tail` is in the corpus."""
        context, tokens, agree, first = list(tail[-self.max_n:]), [], [], 0
        for _ in range(k):
            for n in range(min(self.max_n, len(context)), 0, -1):
                hit = self.table.get(tuple(context[-n:]))
                if hit is not None:
                    break
            else:
                break
            token, count, total = hit
            first = first or n
            tokens.append(token)
            agree.append(count / total)
            context = context[1:] + [token] if len(context) >= self.max_n else context + [token]
        return first, tokens, agree

    def save(self, path: Path) -> None:
        """Write atomically (a temp file beside `path`, then rename)."""
        arrays = {"max_n": np.array(self.max_n, np.int32)}
        for n in range(1, self.max_n + 1):
            rows = [(k, v) for k, v in self.table.items() if len(k) == n]
            arrays[f"keys{n}"] = np.array([k for k, _ in rows], np.int32).reshape(-1, n)
            arrays[f"values{n}"] = np.array([v for _, v in rows], np.int64).reshape(-1, 3)
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(buf.getvalue())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Datastore:
        try:
            with np.load(path, allow_pickle=False) as data:
                max_n = int(data["max_n"])
                table = {}
                for n in range(1, max_n + 1):
                    keys, values = data[f"keys{n}"], data[f"values{n}"]
                    if keys.shape[1:] != (n,) or values.shape != (len(keys), 3):
                        raise ValueError(f"keys{n} {keys.shape} / values{n} {values.shape}")
                    table.update(zip(map(tuple, keys.tolist()), map(tuple, values.tolist())))
        except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
            raise BundleError(f"{path}: unreadable lookup datastore ({e})") from None
        return cls(table, max_n)
