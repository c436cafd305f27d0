"""The Ray Serve application: an ingress deployment in front of N engine replicas.

    HTTP :port -> Serve proxy -> Ingress (FastAPI, no CPUs) --handle, stream,
                  TenantAffinityRouter--> EngineReplica x N (each one engine, its CPUs)

`build(args)` is also the import path for Ray Serve config files (KubeRay's serveConfigV2):
`import_path: dspark.runtime.cluster.app:build`, `args:` the ClusterSpec fields.
"""

from __future__ import annotations

from ray import serve
from ray.serve.config import RequestRouterConfig

from dspark.runtime.cluster.ingress import Ingress
from dspark.runtime.cluster.replica import EngineReplica
from dspark.runtime.cluster.router import TenantAffinityRouter
from dspark.runtime.cluster.spec import ClusterSpec
from dspark.runtime.env import MALLOC_TUNABLES

ENGINE = "EngineReplica"
INGRESS = "Ingress"
DRAIN_S = 30.0  # a replica being stopped finishes its requests for up to this long


def build(args: dict) -> serve.Application:
    """Ray Serve application builder (`serve run dspark.runtime.cluster.app:build model=...`,
    or a Serve config's import_path + args)."""
    return application(ClusterSpec.from_args(args))


def application(spec: ClusterSpec) -> serve.Application:
    scale = ({"autoscaling_config": {
        "min_replicas": spec.autoscale[0], "max_replicas": spec.autoscale[1],
        "target_ongoing_requests": spec.max_batch}} if spec.autoscale is not None
        else {"num_replicas": spec.replicas})
    engine = serve.deployment(EngineReplica, name=ENGINE).options(
        **scale,
        max_ongoing_requests=spec.ongoing,
        max_queued_requests=spec.max_queue * max(spec.replicas, *(spec.autoscale or (1,))),
        user_config={"dflash_config": spec.dflash_config} if spec.dflash_config else None,
        graceful_shutdown_timeout_s=DRAIN_S,
        health_check_period_s=5.0,
        ray_actor_options=_actor_options(spec),
        request_router_config=RequestRouterConfig(
            request_router_class=TenantAffinityRouter,
            request_router_kwargs={"imbalanced_threshold": spec.imbalance}),
    )
    ingress = serve.deployment(serve.ingress()(Ingress), name=INGRESS).options(
        num_replicas=spec.ingress_replicas,
        max_ongoing_requests=100_000,  # the engine replicas bound the work, not the front
        ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(spec), spec)


def _actor_options(spec: ClusterSpec) -> dict:
    env = {"DSPARK_THREADS": str(spec.threads), "OMP_NUM_THREADS": str(spec.threads),
           "GLIBC_TUNABLES": ":".join(MALLOC_TUNABLES)}
    options: dict = {"num_cpus": spec.cpus_per_replica, "runtime_env": {"env_vars": env}}
    if spec.gpus_per_replica:
        options["num_gpus"] = spec.gpus_per_replica
    return options
