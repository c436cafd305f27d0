"""`dsrun cluster`: many engine replicas of one bundle behind one OpenAI endpoint, on Ray
Serve (the optional extra: pip install 'dspark[cluster]')."""

from __future__ import annotations

import os
from pathlib import Path

import click

from dspark.runtime.env import read_env
from dspark.runtime.errors import DSparkError

PathArg = click.Path(path_type=Path)


@click.command()
@click.option("--model", type=PathArg, required=True, help="the .dsmodel bundle")
@click.option("--replicas", type=click.IntRange(min=1), help="engine replicas [default: 1]")
@click.option("--autoscale", metavar="MIN:MAX", help="autoscale between MIN and MAX replicas "
              "(Ray Serve, on ongoing requests) instead of --replicas")
@click.option("--address", help="join a running Ray cluster (auto, ray://host:10001); "
              "default: start a local one on the loopback interface")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True)
@click.option("--cpus-per-replica", type=click.FloatRange(min=0, min_open=True),
              help="CPUs each replica reserves and its engine's threads [default: the "
              "machine's CPUs / replicas]")
@click.option("--gpus-per-replica", type=click.FloatRange(min=0), default=0.0)
@click.option("--ship-bundle", is_flag=True, help="send the bundle with the job (Ray's "
              "working_dir, small bundles) instead of reading --model on every node")
@click.option("--api-key", help="require Authorization: Bearer KEY (or DSPARK_API_KEY)")
@click.option("--max-batch", type=click.IntRange(1, 1024), default=16, show_default=True)
@click.option("--max-queue", type=click.IntRange(1, 100000), default=256, show_default=True,
              help="waiting requests per replica before 429")
@click.option("--imbalance", type=click.IntRange(min=0), default=8, show_default=True,
              help="queue gap at which tenant affinity yields to the least-loaded replica")
@click.option("--config", "config_path", type=PathArg,
              help="dflash_config.json for every replica (hot-reloaded, pushed to all)")
@click.option("--policy", help="window policy (default: the config's)")
@click.option("--served-model-name", "name", help="model id in the API")
@click.option("--ray-metrics-port", type=click.IntRange(1, 65535),
              help="export the local Ray's own Prometheus metrics here [default: a free port]")
@click.option("--no-warmup", is_flag=True)
def cluster(model: Path, replicas, autoscale, address, host, port, cpus_per_replica,
            gpus_per_replica, ship_bundle, api_key, max_batch, max_queue, imbalance,
            config_path, policy, name, ray_metrics_port, no_warmup) -> None:
    """Serve the OpenAI API from several engine replicas on Ray Serve."""
    from dspark.runtime.cluster.spec import ClusterSpec, parse_autoscale

    if replicas is not None and autoscale is not None:
        raise click.UsageError("give --replicas or --autoscale, not both")
    try:
        import ray.serve  # noqa: F401 - the optional extra, imported lazily everywhere else

        from dspark.runtime.cluster.launch import Cluster, run_until_signal
    except ImportError as e:
        raise DSparkError(f"dsrun cluster needs Ray Serve: pip install 'dspark[cluster]' "
                          f"({e})") from None
    scale = parse_autoscale(autoscale) if autoscale is not None else None
    count = replicas or (scale[1] if scale else 1)
    cpus = cpus_per_replica or max(1.0, (os.cpu_count() or 1) // count)
    spec = ClusterSpec(model=str(model), name=name or "", replicas=replicas or 1,
                       autoscale=scale, cpus_per_replica=cpus,
                       gpus_per_replica=gpus_per_replica, max_batch=max_batch,
                       max_queue=max_queue, imbalance=imbalance,
                       api_key=api_key or read_env().api_key,
                       policy=policy, warmup=not no_warmup)
    deployed = Cluster(spec, model, config_path, ship_bundle)
    replicas_text = f"{scale[0]}-{scale[1]}" if scale else str(count)
    click.echo(f"[dsrun] starting {replicas_text} replica(s) of {model} "
               f"({cpus:g} CPU each) on Ray Serve", err=True)
    deployed.start(address, host, port, ray_metrics_port=ray_metrics_port)
    click.echo(f"[dsrun] cluster serving on http://{host}:{port}/v1 (Ctrl-C stops it)",
               err=True)
    run_until_signal(deployed)
