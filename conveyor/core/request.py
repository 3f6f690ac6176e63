"""Request: one generation's tokens, progress and timestamps. Owned and mutated by the Scheduler."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from conveyor.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# Why a request not yet started was passed over in a step: the step's token budget, latency target or
# batch size was spent; the KV blocks were short; a better priority or another tenant's turn came
# first; a prompt sharing its prefix is computing that prefix, so it waits to reuse it.
WAIT_CAUSES = ("budget", "blocks", "priority", "prefix")


class FinishReason(str, enum.Enum):
    STOP = "stop"        # an end token, a stop token or a stop string
    LENGTH = "length"    # max_tokens or the model length
    ABORT = "abort"      # cancelled by the caller
    ERROR = "error"      # the step that ran it failed


@dataclass(slots=True, eq=False)
class Request:
    """Tokens are `prompt_token_ids + output_token_ids`; the KV of the first `num_computed_tokens`
    of them is in the cache, in the blocks of `block_table`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float
    max_tokens: int                      # resolved by admission: params.max_tokens or what the model length leaves
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0                    # lower runs first; FCFS among equals
    is_background: bool = False          # yields its place to better priorities however often (batch jobs)
    tenant: str = ""                     # whose request: admissions are shared fairly between tenants
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0           # prompt tokens found in the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full token blocks
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    arrival_index: int = 0               # set by the scheduler; breaks priority ties in arrival order
    can_speculate: bool = False          # its decodes may carry draft tokens to verify
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    draft_acceptance: float = 0.5        # recent share of draft tokens accepted (moving average)
    first_scheduled_s: float | None = None
    wait_cause: str = "budget"           # why the last step passed it over (WAIT_CAUSES)
    queue_s_by_cause: dict[str, float] = field(default_factory=dict)   # time before its first step, by cause
    queue_mark_s: float | None = None    # queue time is counted up to here
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival_index)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
