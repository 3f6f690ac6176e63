"""Run the replicas application: connect to Ray (or start one on this machine), deploy, wait for a signal.

`conveyor serve --replicas N` builds the configs from its flags and calls `run_replicas`; Ray's own
`serve run` gets the same application from `conveyor.cli:ray_serve_app`, which reads the flags.
"""

from __future__ import annotations

import logging
import signal
import threading

import ray
from ray import serve

from conveyor.config import EngineConfig, ServerConfig
from conveyor.replicas.config import ReplicaConfig
from conveyor.replicas.deployments import build_application

logger = logging.getLogger(__name__)

APP_NAME = "conveyor"


def connect_ray(address: str | None, num_cpus: int | None = None, log_to_driver: bool = True) -> None:
    """Join the cluster at `address`, or start a Ray of our own that listens on loopback only.

    `log_to_driver`: print the replicas' logs (Ray Serve's access log among them) here too.
    """
    if address is not None:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                 log_to_driver=log_to_driver)
        return
    ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level=logging.WARNING, log_to_driver=log_to_driver)


def deploy(config: EngineConfig, server: ServerConfig, replicas: ReplicaConfig) -> None:
    """Start Ray Serve's HTTP proxy on server.host:server.port and deploy; returns once every replica is up."""
    if server.port == 0:
        raise ValueError("--port 0 is not supported with --replicas: Ray's HTTP proxy needs a fixed port")
    serve.start(http_options={"host": server.host, "port": server.port})
    serve.run(build_application(config, server, replicas), name=APP_NAME, route_prefix="/")


def run_replicas(config: EngineConfig, server: ServerConfig, replicas: ReplicaConfig) -> int:
    """Serve until SIGTERM or Ctrl-C, then shut the application down (replicas finish their requests)."""
    connect_ray(replicas.ray_address)
    stop = threading.Event()
    # After ray.init, which installs handlers of its own that end the process at once.
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        deploy(config, server, replicas)
        logger.info("serving %s on http://%s:%d with %s replicas", APP_NAME, server.host, server.port,
                    f"{replicas.lower_bound}..{replicas.upper_bound}" if replicas.is_autoscaling
                    else replicas.num_replicas)
        stop.wait()
        logger.info("shutting down")
        serve.delete(APP_NAME)
        if replicas.ray_address is None:
            serve.shutdown()
    finally:
        ray.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0

