"""The Ray Serve application `conveyor serve --replicas` builds: replica counts, autoscaling bounds, router."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[ray]'): replica tests skipped")

from ray.serve.deployment import Deployment  # noqa: E402

from conveyor.cli import ray_serve_app  # noqa: E402
from conveyor.config import EngineConfig, ServerConfig  # noqa: E402
from conveyor.replicas.config import ReplicaConfig  # noqa: E402
from conveyor.replicas.deployments import build_application  # noqa: E402
from conveyor.replicas.router import PrefixAffinityRouter  # noqa: E402

pytestmark = pytest.mark.ray


def _engine(config: EngineConfig, replicas: ReplicaConfig) -> Deployment:
    ingress = build_application(config, ServerConfig(), replicas)._bound_deployment
    assert ingress.name == "ConveyorIngress"
    return ingress.init_args[0]._bound_deployment


def test_fixed_replicas_with_the_prefix_router() -> None:
    engine = _engine(EngineConfig.from_options(threads=2, max_num_seqs=8), ReplicaConfig(num_replicas=3))
    assert engine.name == "ConveyorEngine" and engine.num_replicas == 3
    assert engine.ray_actor_options["num_cpus"] == 2 and engine.max_ongoing_requests == 16
    router = engine._deployment_config.request_router_config
    assert router.request_router_class == f"{PrefixAffinityRouter.__module__}.{PrefixAffinityRouter.__name__}"
    assert engine._deployment_config.autoscaling_config is None


def test_autoscaling_bounds_go_to_ray_serves_autoscaler() -> None:
    replicas = ReplicaConfig(num_replicas=2, min_replicas=1, max_replicas=4)
    scaling = _engine(EngineConfig.from_options(max_num_seqs=8), replicas)._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.initial_replicas, scaling.max_replicas) == (1, 2, 4)
    assert scaling.target_ongoing_requests == 8   # requests past a full batch wait: time for another replica
    replicas = ReplicaConfig(num_replicas=1, max_replicas=3, target_ongoing_requests=5)
    assert _engine(EngineConfig(), replicas)._deployment_config.autoscaling_config.target_ongoing_requests == 5


def test_serve_run_builder_takes_the_serve_flags() -> None:
    ingress = ray_serve_app({"model": "/models/m.gguf", "replicas": 2, "threads": 1, "max_num_seqs": 4})
    engine = ingress._bound_deployment.init_args[0]._bound_deployment
    config = engine.init_args[0]
    assert engine.num_replicas == 2 and config.model.model == "/models/m.gguf" and config.scheduler.max_num_seqs == 4


def test_max_waiting_requests_bounds_the_routers_queue() -> None:
    def queued(server: ServerConfig) -> int:
        ingress = build_application(EngineConfig(), server, ReplicaConfig(num_replicas=2))._bound_deployment
        return ingress.init_args[0]._bound_deployment._deployment_config.max_queued_requests

    assert queued(ServerConfig()) == -1
    assert queued(ServerConfig(max_waiting_requests=8)) == 8 and queued(ServerConfig(max_waiting_requests=0)) == 1
