"""ClusterBoard: a small Ray actor every engine replica reports to once a second.

- metrics: each replica's latest Prometheus text; `/metrics` on the ingress renders the
  merge. A replica that stopped reporting (killed, scaled down) drops out after STALE_S, so
  a scrape never shows a dead replica's counters as current.
- config: `dsrun cluster` publishes a dflash_config it validated; each replica's next report
  returns it (with its version) until the replica has it, and the replica applies it between
  steps. A replica started later catches up on its first report.
"""

from __future__ import annotations

import time

from dspark.runtime.cluster.exposition import merge

PUSH_S = 1.0
STALE_S = 10.0
BOARD_NAMESPACE = "dspark"


class ClusterBoard:
    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, str]] = {}
        self.config: dict | None = None
        self.version = 0

    def report(self, replica: str, text: str, seen: int) -> tuple[int, dict] | None:
        """A replica's metrics; returns (version, config) when it has not seen the latest."""
        self.texts[replica] = (time.monotonic(), text)
        if self.config is not None and self.version > seen:
            return self.version, self.config
        return None

    def publish(self, config: dict) -> int:
        self.config, self.version = config, self.version + 1
        return self.version

    def forget(self, replica: str) -> None:
        self.texts.pop(replica, None)

    def replicas(self) -> list[str]:
        self._prune()
        return sorted(self.texts)

    def render(self) -> str:
        self._prune()
        return merge(text for _, (_, text) in sorted(self.texts.items()))

    def _prune(self) -> None:
        now = time.monotonic()
        for replica, (at, _) in list(self.texts.items()):
            if now - at > STALE_S:
                del self.texts[replica]


def board_handle(app_name: str):
    """The app's board, created by whoever asks first (detached: it outlives any one
    replica; `dsrun cluster` removes it on exit)."""
    import ray

    return ray.remote(ClusterBoard).options(
        name=board_name(app_name), namespace=BOARD_NAMESPACE, lifetime="detached",
        get_if_exists=True, num_cpus=0).remote()


def board_name(app_name: str) -> str:
    return f"dspark-board-{app_name}"
