"""StepPlan and StepResult: the contract between the scheduler and the runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.core.request import FinishReason


@dataclass(frozen=True, slots=True)
class ScheduledRow:
    """One request's share of a step: compute `token_ids` at positions start_position, ..."""

    request_id: str
    token_ids: list[int]
    start_position: int        # tokens of this request already in the cache
    block_table: list[int]     # covers start_position + len(token_ids) tokens
    is_sampling: bool          # the chunk reaches the end of the request's tokens: sample one
    is_prefill: bool           # computing prompt (or recomputed) tokens rather than decoding
    num_draft_tokens: int = 0  # the last this many tokens are guesses to verify: sample at each of them too
    num_prompt_logits: int = 0  # the first this many tokens' logits score the prompt token after each

    @property
    def num_logits(self) -> int:
        """Positions sampled: the guesses and the token before them, or the last token, or none."""
        return self.num_draft_tokens + 1 if self.is_sampling else 0

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    rows: tuple[ScheduledRow, ...]
    preempted_ids: tuple[str, ...] = ()
    finished_ids: tuple[str, ...] = ()   # left since the last plan; the runner may drop their state

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {row.request_id: row.num_tokens for row in self.rows}

    @property
    def sampling_ids(self) -> list[str]:
        return [row.request_id for row in self.rows if row.is_sampling]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(row.num_tokens for row in self.rows if row.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(row.num_tokens for row in self.rows if not row.is_prefill)

    @property
    def is_empty(self) -> bool:
        return not self.rows


@dataclass(slots=True)
class RequestUpdate:
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_draft_tokens: int = 0      # guesses verified this step
    num_accepted_tokens: int = 0   # of them, the leading run the model agreed with


@dataclass(slots=True)
class StepResult:
    updates: list[RequestUpdate] = field(default_factory=list)
