"""Fair sharing between tenants: virtual token counters ("Fairness in Serving Large Language Models", VTC).

Each tenant with live requests has a counter of the service it received, divided by its weight:
prompt tokens when a request is first admitted (those found in the prefix cache are free), output
tokens (weighted OUTPUT_TOKEN_WEIGHT, as each costs a step of the whole model) as they are emitted.
Within a priority level the scheduler admits the head request of the tenant with the lowest
counter, so a tenant with 200 queued requests and one with a single request take turns. A tenant
that becomes active starts at the lowest counter among the active ones: time spent idle is not
credit to be spent later, and a newcomer waits at most about one admission. A tenant's counter is
dropped when it has no live request, which bounds the state by the live tenants.

Pure Python: the scheduler owns one and calls it; no clock, no threads.
"""

from __future__ import annotations

from collections.abc import Mapping

OUTPUT_TOKEN_WEIGHT = 2.0


class TenantShares:
    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self.weights = dict(weights or {})
        self.counters: dict[str, float] = {}
        self.live: dict[str, int] = {}        # tenant -> live requests (waiting or running)
        self.running: dict[str, int] = {}     # tenant -> running requests

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def join(self, tenant: str) -> None:
        """A request of `tenant` arrived; an inactive tenant starts level with the least served active one."""
        if self.live.get(tenant, 0) == 0:
            self.counters[tenant] = min(self.counters.values(), default=0.0)
        self.live[tenant] = self.live.get(tenant, 0) + 1

    def leave(self, tenant: str) -> None:
        left = self.live.get(tenant, 0) - 1
        if left > 0:
            self.live[tenant] = left
        else:
            self.live.pop(tenant, None)
            self.counters.pop(tenant, None)
            self.running.pop(tenant, None)

    def started(self, tenant: str, delta: int) -> None:
        """A request of `tenant` started running (+1) or stopped (-1: finished or preempted)."""
        self.running[tenant] = self.running.get(tenant, 0) + delta

    def charge(self, tenant: str, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        if tenant in self.counters:
            self.counters[tenant] += (prompt_tokens + OUTPUT_TOKEN_WEIGHT * output_tokens) / self.weight(tenant)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)
