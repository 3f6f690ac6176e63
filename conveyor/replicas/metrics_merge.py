"""Every replica's /metrics text -> one Prometheus exposition, each sample labelled with its replica.

The ingress's /metrics asks every replica for its metrics as of the scrape and serves the merge,
so one scrape target covers the whole deployment. Replicas also push their metrics to the
`MetricsHub` deployment (deployments.py) every few seconds: the hub knows which replicas exist, and
its copy stands in for a replica that does not answer the scrape in time. Merging the text keeps `server/metrics.py` the one owner of what is measured, under
the same names (`vllm:*` with `model_name`, `conveyor:*`) as a single server: dashboards sum over
the new `replica` label.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

REPLICA_LABEL = "replica"


class MetricsStore:
    """The last text each replica pushed; a replica silent for `stale_after_s` is left out (it died)."""

    def __init__(self, stale_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after_s = stale_after_s
        self.clock = clock
        self._texts: dict[str, tuple[float, str]] = {}

    def push(self, replica_id: str, text: str) -> None:
        self._texts[replica_id] = (self.clock(), text)

    def texts(self) -> dict[str, str]:
        now = self.clock()
        for replica_id in [r for r, (at, _) in self._texts.items() if now - at > self.stale_after_s]:
            del self._texts[replica_id]
        return {replica_id: text for replica_id, (_, text) in sorted(self._texts.items())}


def merge_metrics(texts: dict[str, str]) -> bytes:
    """One exposition: each family once, with the samples of every replica."""
    families: dict[str, Metric] = {}
    for replica_id, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            merged.samples.extend(Sample(s.name, {**s.labels, REPLICA_LABEL: replica_id}, s.value, s.timestamp,
                                         s.exemplar) for s in family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)
