"""Request: one generation's tokens, progress and timestamps. Owned and mutated by the Scheduler."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from conveyor.sampling_params import SamplingParams


MAX_SCORED_CHUNK = 256   # prompt positions scored per step: 256 x a 152k vocabulary = 156 MB of float32 logits


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
    num_published_blocks: int = 0        # leading blocks of block_table already in the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    arrival_index: int = 0               # set by the scheduler; breaks priority ties in arrival order
    can_speculate: bool = False          # its decodes may carry draft tokens to verify
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    draft_acceptance: float = 0.5        # recent share of draft tokens accepted (moving average)
    steps_without_drafts: int = 0        # decodes since its last guess was granted
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

    @property
    def wants_prompt_logits(self) -> bool:
        """Its prompt is to be scored (prompt logprobs) and is not yet."""
        return self.params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def skips_prefix_cache(self) -> bool:
        """Asked not to use cached blocks, or a prompt to score: a cached block's tokens are never computed."""
        return not self.params.use_prefix_cache or self.wants_prompt_logits

    def max_chunk(self, start: int, budget: int) -> int:
        """The most tokens a chunk from `start` may take within `budget`: a prompt being scored has logits
        at every position, (chunk, vocabulary) float32, so its chunks are kept short."""
        return min(self.num_tokens - start, budget, MAX_SCORED_CHUNK if self.wants_prompt_logits else budget)

    def num_prompt_logits(self, start: int, end: int) -> int:
        """Of the positions [start, end) computed in a step, how many lead to a prompt token to score:
        position p's logits give prompt token p + 1's logprob (the last prompt token's are sampled)."""
        if not self.wants_prompt_logits:
            return 0
        return max(0, min(end, self.num_prompt_tokens - 1) - start)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
