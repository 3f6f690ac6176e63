"""BatchSnapshot: what the batch looks like right now, for a live view; and when the core takes one.

Pure Python, read-only over the scheduler's requests and the block manager. The core takes a
snapshot only while someone watches (`SnapshotSchedule.interval_s` set), at most once per
interval, so an unwatched engine computes and sends nothing extra.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from conveyor.core.block_manager import BlockManager
from conveyor.core.request import Request, RequestStatus

MAX_WAITING_ROWS = 64   # waiting requests listed one by one; the rest are only counted


class RowState(str, enum.Enum):
    WAITING = "waiting"          # never scheduled yet
    PREFILLING = "prefilling"    # computing its prompt (or recomputing it after a preemption)
    DECODING = "decoding"
    PREEMPTED = "preempted"      # back in the waiting queue, its tokens kept


class BlockState(enum.IntEnum):
    """One byte per KV block: bit 0 = held by a request, bit 1 = in the prefix cache (hashed)."""

    FREE = 0
    IN_USE = 1
    CACHED = 2          # free, but its KV is kept for reuse until the block is taken
    IN_USE_CACHED = 3   # held, and findable by a request with the same prefix (shareable)


@dataclass(frozen=True, slots=True)
class RequestRow:
    request_id: str
    state: RowState
    num_prompt_tokens: int
    num_computed_prompt_tokens: int
    num_output_tokens: int
    max_tokens: int
    priority: int
    tenant: str
    arrival_s: float
    first_token_s: float | None
    num_cached_tokens: int       # prompt tokens found in the prefix cache at admission
    num_preemptions: int
    num_blocks: int
    num_step_tokens: int = 0         # tokens the last step computed for it
    wait_cause: str | None = None    # never scheduled yet: why the last step passed it over (WAIT_CAUSES)


@dataclass(frozen=True, slots=True)
class BatchSnapshot:
    """Running requests (batch order), then the first MAX_WAITING_ROWS waiting ones, and the block map."""

    time_s: float                      # the core's clock (time.monotonic, shared by the front)
    rows: tuple[RequestRow, ...]
    num_running: int
    num_waiting: int                   # all of them, listed or not
    block_states: bytes                # BlockState per block id
    num_prefix_query_tokens: int       # since start
    num_prefix_hit_tokens: int


def row_of(request: Request, served: Mapping[str, int], is_scheduled: bool = True) -> RequestRow:
    """`is_scheduled`: the scheduler holds it (a request whose grammar compiles has no wait cause yet)."""
    if request.status is RequestStatus.RUNNING:
        # A decode has exactly one token left to compute; more means a prompt (or a resume) in progress.
        state = RowState.DECODING if request.num_tokens - request.num_computed_tokens <= 1 else RowState.PREFILLING
    else:
        state = RowState.PREEMPTED if request.num_preemptions else RowState.WAITING
    return RequestRow(
        request_id=request.request_id, state=state, num_prompt_tokens=request.num_prompt_tokens,
        num_computed_prompt_tokens=min(request.num_computed_tokens, request.num_prompt_tokens),
        num_output_tokens=len(request.output_token_ids), max_tokens=request.max_tokens,
        priority=request.priority, tenant=request.tenant, arrival_s=request.arrival_s,
        first_token_s=request.first_token_s, num_cached_tokens=request.num_cached_tokens,
        num_preemptions=request.num_preemptions, num_blocks=len(request.block_table),
        num_step_tokens=served.get(request.request_id, 0),
        wait_cause=request.wait_cause if is_scheduled and request.first_scheduled_s is None else None)


def block_states(blocks: BlockManager) -> bytes:
    return bytes((ref_count > 0) | ((block_hash is not None) << 1)
                 for ref_count, block_hash in zip(blocks.ref_counts, blocks.block_hashes))


def take_snapshot(now_s: float, running: Sequence[Request], waiting: Sequence[Request], blocks: BlockManager,
                  more_waiting: Iterable[Request] = (), served: Mapping[str, int] | None = None) -> BatchSnapshot:
    """`more_waiting`: requests the scheduler does not hold yet (grammars still compiling); `served`:
    request id -> tokens the last step computed for it."""
    queued = [*waiting, *more_waiting]
    served = served or {}
    rows = [row_of(r, served) for r in running] + [row_of(r, served, i < len(waiting))
                                                   for i, r in enumerate(queued[:MAX_WAITING_ROWS])]
    return BatchSnapshot(time_s=now_s, rows=tuple(rows), num_running=len(running), num_waiting=len(queued),
                         block_states=block_states(blocks), num_prefix_query_tokens=blocks.num_query_tokens,
                         num_prefix_hit_tokens=blocks.num_hit_tokens)


class SnapshotSchedule:
    """When the core attaches a snapshot to its message: never while `interval_s` is None, else at
    most once per interval, and always on the message that leaves the core idle (the last state
    must reach the viewers, or a finished request would stay on screen)."""

    def __init__(self) -> None:
        self.interval_s: float | None = None
        self.last_s = -math.inf

    def watch(self, interval_s: float | None) -> None:
        self.interval_s = interval_s
        self.last_s = -math.inf    # a new viewer gets the current state at once

    def is_due(self, now_s: float, is_idle: bool) -> bool:
        if self.interval_s is None:
            return False
        if is_idle or now_s - self.last_s >= self.interval_s:
            self.last_s = now_s
            return True
        return False
