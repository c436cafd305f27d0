"""Ray Serve request router for engine replicas: tenant / conversation affinity
(routing.rank), falling back to the least-loaded replica when the preferred one is busier
by more than `imbalanced_threshold` requests or refuses (full at max_ongoing_requests).

Used as `RequestRouterConfig(request_router_class=TenantAffinityRouter)`; the routing key
travels in the request's first argument (forward.Forwarded.route_key), set by the ingress.
No FIFOMixin: a replica found for one request must serve that request, not the oldest
pending one of another tenant.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from dspark.runtime.cluster.routing import rank

DEFAULT_IMBALANCE = 8


class TenantAffinityRouter(RequestRouter):
    def initialize_state(self, imbalanced_threshold: int = DEFAULT_IMBALANCE, **_) -> None:
        self.imbalance = int(imbalanced_threshold)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {rid: self.replica_queue_len_cache.get(r.replica_id)
                 for rid, r in by_id.items()}
        key = _key_of(pending_request)
        groups = rank(key, list(by_id), loads, getattr(self, "imbalance", DEFAULT_IMBALANCE))
        return [[by_id[rid] for rid in group] for group in groups]


def _key_of(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None or not pending_request.args:
        return None
    return getattr(pending_request.args[0], "route_key", None)
