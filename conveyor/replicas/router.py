"""Ray Serve request router for the engine replicas: prefix affinity, then the least loaded.

Ray Serve's default router (power of two choices) picks two replicas at random and sends to the
one with fewer requests in flight: balanced, but blind to prompts, so requests sharing a system
prompt land on every replica and each one computes that prefix into its own cache. This router
sends a request to the replica that last served the same first blocks of prompt (routing.py),
unless that replica is much busier than the idlest one, and otherwise to the least loaded replica:
load is the engine's running + waiting requests as each replica reports them
(`record_routing_stats`), or the requests Serve has in flight to it when that count is fresher.
A key that names a replica (a /metrics scrape's call) goes to that replica.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from conveyor.replicas.routing import DEFAULT_IMBALANCE, PrefixTable, RoutingKey, rank_replicas

ROUTING_KEY_ARG = "routing_key"   # the keyword argument of the engine call that carries the key


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = DEFAULT_IMBALANCE, table_capacity: int = 1 << 16) -> None:
        self.imbalance = imbalance
        self.table = PrefixTable(table_capacity)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = _key_of(pending_request)
        if key.replica_id is not None:
            # A call for one replica; if it is gone, any replica answers (the answer names who did).
            target = [r for r in candidate_replicas if r.replica_id.to_full_id_str() == key.replica_id]
            return [target or candidate_replicas]
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        loads = {replica_id: self._load(replica) for replica_id, replica in by_id.items()}
        preferred = self.table.lookup(key) if key.block_hashes else None
        ranks = rank_replicas(loads, preferred, key.sticky, self.imbalance)
        return [[by_id[replica_id] for replica_id in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        key = _key_of(pending_request)
        if key.block_hashes:
            self.table.record(key, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget({r.unique_id for r in self.curr_replicas})

    def _load(self, replica: RunningReplica) -> int:
        stats = replica.routing_stats or {}
        reported = int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0))
        in_flight = self.replica_queue_len_cache.get(replica.replica_id) or 0
        return max(reported, in_flight)


def _key_of(pending_request: PendingRequest | None) -> RoutingKey:
    key = pending_request.kwargs.get(ROUTING_KEY_ARG) if pending_request is not None else None
    return key if isinstance(key, RoutingKey) else RoutingKey()
