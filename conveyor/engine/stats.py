"""Step and request statistics, as plain data for the metrics layer and the benchmark."""

from __future__ import annotations

from dataclasses import astuple, dataclass, field, fields
from operator import attrgetter
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from conveyor.runtime.kv.prefix_tier import PrefixTiers


_T = TypeVar("_T")


def pickled_by_fields(cls: type[_T]) -> type[_T]:
    """Pickle a slotted dataclass as its constructor's arguments in order: by default its state goes as a
    dict of slots, ~4x slower to write and ~7x to read, and every step sends one message of these."""
    get = attrgetter(*(f.name for f in fields(cls)))
    cls.__reduce__ = lambda self: (cls, get(self))
    return cls


@dataclass(frozen=True, slots=True)
class DiskTierCounts:
    """The disk tier's counters: one step's, or totals."""

    num_query_tokens: int = 0    # prompt tokens past the memory hits looked up on disk
    num_hit_tokens: int = 0      # tokens read back from disk and then used by a request
    bytes_read: int = 0
    bytes_written: int = 0

    def __add__(self, other: DiskTierCounts) -> DiskTierCounts:
        return DiskTierCounts(*(a + b for a, b in zip(astuple(self), astuple(other))))


@dataclass(frozen=True, slots=True)
class HostTierCounts:
    """The host memory tier's counters: one step's, or totals (`nbytes`: the latest)."""

    num_query_tokens: int = 0    # prompt tokens past the memory hits looked up in host memory
    num_hit_tokens: int = 0      # tokens copied back from host memory and then used by a request
    bytes_read: int = 0          # host -> KV cache
    bytes_written: int = 0       # KV cache -> host
    nbytes: int = 0              # held in host memory after the step

    def __add__(self, other: HostTierCounts) -> HostTierCounts:
        sums = (a + b for a, b in zip(astuple(self)[:4], astuple(other)[:4]))
        return HostTierCounts(*sums, nbytes=other.nbytes)


def tier_counts(tier: PrefixTiers | None) -> dict[str, DiskTierCounts | HostTierCounts | None]:
    """The second tiers' counts since the last call, as StepStats fields."""
    if tier is None:
        return {}
    disk, host = tier.take_counts()
    return {"disk": DiskTierCounts(*disk) if disk is not None else None,
            "host": HostTierCounts(*host) if host is not None else None}


@dataclass(slots=True)
class DraftTally:
    """One step's speculative decoding counts, for its StepStats."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if num_draft_tokens:
            self.num_drafts += 1
            self.num_draft_tokens += num_draft_tokens
            self.num_accepted_tokens += num_accepted_tokens
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
            for i in range(num_accepted_tokens):
                self.accepted_per_position[i] += 1


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class StepStats:
    num_prefill_tokens: int
    num_decode_tokens: int
    num_rows: int                 # sequences in the step's batch
    step_time_s: float
    num_running: int              # after the step
    num_waiting: int
    num_kv_blocks_used: int
    kv_usage: float               # fraction of KV blocks in use
    num_preemptions: int          # in this step
    num_prefix_query_tokens: int  # prompt tokens looked up in the prefix cache this step
    num_prefix_hit_tokens: int
    num_drafts: int = 0           # decodes that carried draft tokens
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()   # [i]: drafts whose (i+1)-th guess held
    disk: DiskTierCounts | None = None            # the prefix cache's disk tier, where there is one
    host: HostTierCounts | None = None            # its host memory tier, where there is one

    @property
    def num_prefix_memory_hit_tokens(self) -> int:
        """Hits on blocks the KV cache kept, not those the second tiers gave back."""
        return (self.num_prefix_hit_tokens - (self.disk.num_hit_tokens if self.disk is not None else 0)
                - (self.host.num_hit_tokens if self.host is not None else 0))

    @property
    def is_decode(self) -> bool:
        """A step that decodes anything counts as decode, even if it also prefills."""
        return self.num_decode_tokens > 0


@dataclass(slots=True)
class EngineStats:
    """Running totals over steps; throughput per phase comes from the time of that phase's steps."""

    num_steps: int = 0
    num_rows: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    prefill_only_tokens: int = 0
    prefill_only_time_s: float = 0.0
    decode_step_tokens: int = 0       # decode tokens of steps that decode
    decode_time_s: float = 0.0
    num_preemptions: int = 0
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_drafts: int = 0               # decodes that carried draft tokens
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)   # [i]: drafts whose (i+1)-th guess held
    disk: DiskTierCounts = field(default_factory=DiskTierCounts)
    host: HostTierCounts = field(default_factory=HostTierCounts)

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def record(self, step: StepStats) -> None:
        self.num_steps += 1
        self.num_rows += step.num_rows
        self.num_prefill_tokens += step.num_prefill_tokens
        self.num_decode_tokens += step.num_decode_tokens
        self.num_preemptions += step.num_preemptions
        self.num_prefix_query_tokens += step.num_prefix_query_tokens
        self.num_prefix_hit_tokens += step.num_prefix_hit_tokens
        self.num_drafts += step.num_drafts
        self.num_draft_tokens += step.num_draft_tokens
        self.num_accepted_tokens += step.num_accepted_tokens
        if step.disk is not None:
            self.disk += step.disk
        if step.host is not None:
            self.host += step.host
        for i, count in enumerate(step.accepted_per_position):
            if i == len(self.accepted_per_position):
                self.accepted_per_position.append(0)
            self.accepted_per_position[i] += count
        if step.is_decode:
            self.decode_step_tokens += step.num_decode_tokens
            self.decode_time_s += step.step_time_s
        else:
            self.prefill_only_tokens += step.num_prefill_tokens
            self.prefill_only_time_s += step.step_time_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_step_tokens / self.decode_time_s if self.decode_time_s else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_only_tokens / self.prefill_only_time_s if self.prefill_only_time_s else 0.0

    @property
    def avg_rows_per_step(self) -> float:
        return self.num_rows / self.num_steps if self.num_steps else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hit_tokens / self.num_prefix_query_tokens if self.num_prefix_query_tokens else 0.0
