"""Which replica gets a request: the one that served the same prompt prefix, else the least loaded.

Pure Python (no Ray), so the policy is tested without a cluster; `router.py` plugs it into Ray
Serve. A request's routing key is the chain of hashes of its prompt's first full KV blocks, the
same chain the block manager's prefix cache uses, so "same key" means "same cached blocks".
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.core.block_manager import hash_block

ROUTING_BLOCKS = 4          # leading blocks hashed: enough to tell system prompts apart, cheap to tokenize
DEFAULT_IMBALANCE = 16      # a prefix's replica is passed over once it has this many more requests than the idlest


@dataclass(frozen=True, slots=True)
class RoutingKey:
    """What the router knows of a request: its prefix hashes, shortest first.

    `sticky` requests (the Batches and Files API, whose state lives in one replica) always go to
    the replica that served their key, however loaded it is. `replica_id` (a replica's full id)
    sends a call to that one replica: a /metrics scrape asks each replica for its current values.
    """

    block_hashes: tuple[bytes, ...] = ()
    sticky: bool = False
    replica_id: str | None = None


def prefix_key(token_ids: Sequence[int], block_size: int, max_blocks: int = ROUTING_BLOCKS) -> RoutingKey:
    """The chained hashes of the first `max_blocks` full blocks (none for a prompt under one block)."""
    hashes: list[bytes] = []
    for i in range(min(max_blocks, len(token_ids) // block_size)):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * block_size:(i + 1) * block_size]))
    return RoutingKey(tuple(hashes))


class PrefixTable:
    """Prefix hash -> the replica that last served it, least recently used dropped past `capacity`."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._replica_of: OrderedDict[bytes, str] = OrderedDict()

    def lookup(self, key: RoutingKey) -> str | None:
        """The replica of the longest recorded prefix of the key."""
        for block_hash in reversed(key.block_hashes):
            replica_id = self._replica_of.get(block_hash)
            if replica_id is not None:
                self._replica_of.move_to_end(block_hash)
                return replica_id
        return None

    def record(self, key: RoutingKey, replica_id: str) -> None:
        for block_hash in key.block_hashes:
            self._replica_of[block_hash] = replica_id
            self._replica_of.move_to_end(block_hash)
        while len(self._replica_of) > self.capacity:
            self._replica_of.popitem(last=False)

    def forget(self, replica_ids: set[str]) -> None:
        """Drop the entries of replicas that are gone."""
        for block_hash in [h for h, r in self._replica_of.items() if r not in replica_ids]:
            del self._replica_of[block_hash]


def rank_replicas(loads: dict[str, int], preferred: str | None, sticky: bool = False,
                  imbalance: int = DEFAULT_IMBALANCE, rng: random.Random | None = None) -> list[list[str]]:
    """Ranks of replica ids, best first: the prefix's replica (unless it is `imbalance` requests
    busier than the idlest one, or gone), then every replica in tiers of equal load, least loaded
    first. Ray Serve takes the first rank with room and, inside it, the replica with the fewest
    requests it has sent; ties are shuffled so idle replicas share the work."""
    rng = rng or random
    ranks: list[list[str]] = []
    if preferred in loads and (sticky or loads[preferred] - min(loads.values()) <= imbalance):
        ranks.append([preferred])
    for load in sorted(set(loads.values())):
        tier = [replica_id for replica_id, value in loads.items() if value == load]
        rng.shuffle(tier)
        ranks.append(tier)
    return ranks
