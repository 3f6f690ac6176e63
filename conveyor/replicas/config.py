"""The replicas' configuration: how many engines Ray Serve runs and how it scales them."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config_values import positive as _positive


@dataclass(frozen=True)
class ReplicaConfig:
    """Engines as Ray Serve replicas behind Ray's HTTP proxy (`conveyor serve --replicas N`).

    With `min_replicas` or `max_replicas` set, Ray Serve's autoscaler keeps the count between them
    (starting at `num_replicas`), adding a replica when the requests in flight per replica pass
    `target_ongoing_requests`; otherwise the count stays at `num_replicas`.
    """

    num_replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: int | None = None   # None: max_num_seqs, so replicas are added once requests wait
    ray_address: str | None = None               # None: a Ray of our own, on loopback; "auto" or HOST:PORT: a cluster
    metrics_push_interval_s: float = 2.0         # how often each replica sends its /metrics to the merged one

    def __post_init__(self) -> None:
        _positive("num_replicas", self.num_replicas)
        _positive("target_ongoing_requests", self.target_ongoing_requests, allow_none=True)
        if self.min_replicas is not None and (isinstance(self.min_replicas, bool) or not isinstance(
                self.min_replicas, int) or self.min_replicas < 0):
            raise ValueError(f"min_replicas must be a non-negative integer, got {self.min_replicas!r}")
        _positive("max_replicas", self.max_replicas, allow_none=True)
        if self.is_autoscaling and not self.lower_bound <= self.num_replicas <= self.upper_bound:
            raise ValueError(f"replicas must lie between min_replicas and max_replicas: {self.lower_bound} <= "
                             f"{self.num_replicas} <= {self.upper_bound} does not hold")
        if not 0 < self.metrics_push_interval_s < float("inf"):
            raise ValueError(f"metrics_push_interval_s must be a positive number of seconds, "
                             f"got {self.metrics_push_interval_s!r}")

    @property
    def is_autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def lower_bound(self) -> int:
        return self.min_replicas if self.min_replicas is not None else min(1, self.num_replicas)

    @property
    def upper_bound(self) -> int:
        return self.max_replicas if self.max_replicas is not None else max(self.num_replicas, self.lower_bound)
