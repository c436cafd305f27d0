"""`dsrun cluster`: start (or join) Ray, deploy the application, keep the config in sync.

    ray.init (a local Ray, or --address) -> serve.start(host, port) -> serve.run(app)
      loop: dflash_config.json changed? validate once -> publish on the ClusterBoard; every
            replica picks it up within a second and applies it between steps (no restart)
      SIGTERM/SIGINT: delete the app (replicas drain), stop Ray if we started it
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import replace
from pathlib import Path

from dspark.runtime.bundle.bundle import open_bundle
from dspark.runtime.bundle.config import CONFIG_FILE
from dspark.runtime.cluster.spec import SHIPPED, ClusterSpec
from dspark.runtime.dflash.reload import ConfigWatcher
from dspark.runtime.env import quiet_ray_serve

log = logging.getLogger("dspark.cluster")
APP = "dspark"
POLL_S = 0.5


class Cluster:
    """A deployed application; `sync_config()` pushes a changed config file to it."""

    def __init__(self, spec: ClusterSpec, bundle: Path, config: Path | None, ship: bool):
        # refuse a bad bundle or config before starting anything
        checked = open_bundle(bundle, config_path=config)
        self.config_path = config or checked.path(CONFIG_FILE)
        self.watcher = ConfigWatcher(self.config_path, checked.config)
        self.ship = ship
        self.bundle = bundle.resolve()
        self.spec = replace(spec, model=SHIPPED if ship else str(self.bundle),
                            name=spec.name or self.bundle.name.removesuffix(".dsmodel"),
                            dflash_config=self.watcher.config.to_dict())
        self.started_ray = False

    def start(self, address: str | None, host: str, port: int,
              ray_metrics_port: int | None = None) -> None:
        """`ray_metrics_port`: where a local Ray's own Prometheus metrics are exported (Ray's
        metrics agent, Serve's ray_serve_* series included); default: a free port Ray picks."""
        import ray
        from ray import serve

        # the bundle as the job's working_dir: Ray uploads it, Serve replicas inherit it
        shipped = {"runtime_env": {"working_dir": str(self.bundle)}} if self.ship else {}
        if address is None:
            quiet_ray_serve()
            ray.init(address="local", include_dashboard=False,
                     log_to_driver=False, _metrics_export_port=ray_metrics_port,
                     namespace=APP, configure_logging=False, **shipped)
            self.started_ray = True
        else:
            ray.init(address=address, namespace=APP, log_to_driver=False, **shipped)
        serve.start(http_options={"host": host, "port": port})
        self.deploy()

    def deploy(self) -> None:
        from ray import serve

        from dspark.runtime.cluster.app import application

        serve.run(application(self.spec), name=APP, route_prefix="/",
                  blocking=False)

    def sync_config(self, force: bool = False) -> bool:
        """Publish the config file's new content to every replica if it changed and is valid
        (an invalid file is logged by the watcher and the replicas keep theirs)."""
        import ray

        from dspark.runtime.cluster.board import board_handle

        config = self.watcher.poll(force)
        if config is None:
            return False
        version = ray.get(board_handle(APP).publish.remote(config.to_dict()))
        log.info("config %s published to every replica (version %d)", self.config_path,
                 version)
        return True

    def stop(self) -> None:
        import ray
        from ray import serve

        from dspark.runtime.cluster.board import BOARD_NAMESPACE, board_name

        try:
            serve.delete(APP)
            ray.kill(ray.get_actor(board_name(APP), namespace=BOARD_NAMESPACE))
        except Exception as e:  # noqa: BLE001 - best effort on the way out
            log.warning("cluster teardown: %s", e)
        if self.started_ray:
            serve.shutdown()
            ray.shutdown()


def run_until_signal(cluster: Cluster) -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: setattr(cluster.watcher, "requested", True))
    try:
        while not stop.wait(POLL_S):
            cluster.sync_config()
    finally:
        cluster.stop()
