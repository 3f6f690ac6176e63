"""The messages between the API front and the engine core, and the per-request output types.

Both sides import this module and nothing heavier: it holds no torch and no text code. The front
sends `CoreRequest`s and `CoreCommand`s; the core answers with one `StepOutputs` per step, holding
every row's new token ids (never text). The front turns those into `RequestOutput`s (text deltas).
Everything here is a slotted dataclass, so a message pickles small and fast across a pipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conveyor.config import SchedulerConfig
from conveyor.core.snapshot import BatchSnapshot
from conveyor.engine.stats import pickled_by_fields
from conveyor.sampling_params import SamplingParams

if TYPE_CHECKING:
    from conveyor.core.request import Request
    from conveyor.engine.stats import StepStats
    from conveyor.errors import ConveyorError
    from conveyor.logprobs import PromptLogprob, TokenLogprobs


# ------------------------------------------------------------------ front -> core


@dataclass(slots=True)
class CoreRequest:
    """A request already validated and tokenized by the front; the core only queues and runs it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                  # resolved by admission: params.max_tokens or what the model length leaves
    eos_token_ids: frozenset[int]
    arrival_s: float                 # time.monotonic() of the front: one clock for every process
    priority: int = 0
    tenant: str = ""                 # the OpenAI `user` or the X-Tenant header; "" = the default tenant
    is_background: bool = False      # a batch job's line: preemptible for better priorities however often


@dataclass(slots=True)
class AddRequests:
    requests: list[CoreRequest]


@dataclass(slots=True)
class AbortRequests:
    """Drop these requests in any state; their KV blocks are free before the next step."""

    request_ids: list[str]


@dataclass(slots=True)
class FinishRequests:
    """End requests whose stop string the front found: (request id, the stop string)."""

    stops: list[tuple[str, str]]


@dataclass(slots=True)
class WatchBatch:
    """Attach a BatchSnapshot to a message at most every `interval_s` seconds; None stops it."""

    interval_s: float | None


@dataclass(slots=True)
class Shutdown:
    """Leave the busy loop after the step in progress."""


CoreCommand = AddRequests | AbortRequests | FinishRequests | WatchBatch | Shutdown


# ------------------------------------------------------------------ core -> front


@dataclass(slots=True)
class CoreInfo:
    """What the front needs from the loaded model to admit requests; the core's first message."""

    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    startup_s: float                 # model load and cache allocation inside the core
    num_threads: int = 1             # torch intra-op threads the core computes with
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)   # in force, preset and flags applied
    dtype: str = "float32"           # the working dtype the core chose
    kv_cache_dtype: str = "float32"  # the KV cache's: float32, bfloat16, float16 or int8
    kv_cache_bytes: int = 0          # the KV cache's memory, scales included
    weights: str = ""                # the weights' formats as they run ("Q4_K x12, Q8_0 x13", or the dtype)
    enable_prefix_caching: bool = True
    model_path: str = ""             # resolved: the front's grammar cache is keyed on it, as the core's is
    prefix_cache_folder: str = ""    # the disk tier's folder for this model ("" without one): named prompts


@pickled_by_fields
@dataclass(slots=True)
class RequestMetrics:
    arrival_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    finished_s: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    num_draft_tokens: int = 0        # guesses verified for it (speculative decoding)
    num_accepted_tokens: int = 0
    tenant: str = ""
    max_tokens: int = 0              # resolved: what the request was allowed to generate
    queue_s_by_cause: dict[str, float] = field(default_factory=dict)   # queue time split by core.request.WAIT_CAUSES

    @classmethod
    def of(cls, request: Request) -> RequestMetrics:
        """A core request's figures so far."""
        return cls(arrival_s=request.arrival_s, first_scheduled_s=request.first_scheduled_s,
                   first_token_s=request.first_token_s, finished_s=request.finished_s,
                   num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=len(request.output_token_ids),
                   num_cached_tokens=request.num_cached_tokens, num_preemptions=request.num_preemptions,
                   num_draft_tokens=request.num_draft_tokens, num_accepted_tokens=request.num_accepted_tokens,
                   tenant=request.tenant, max_tokens=request.max_tokens,
                   queue_s_by_cause=dict(request.queue_s_by_cause))

    @property
    def queue_time_s(self) -> float | None:
        return None if self.first_scheduled_s is None else self.first_scheduled_s - self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.arrival_s


@pickled_by_fields
@dataclass(slots=True)
class TokenDelta:
    """One request's progress in one step: token ids only. `metrics` is set on the last one."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None   # with the first token, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@pickled_by_fields
@dataclass(slots=True)
class CoreLoad:
    """The core's queues after the message's step; scrapes read it even when nothing runs."""

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    kv_usage: float


@pickled_by_fields
@dataclass(slots=True)
class StepOutputs:
    """Everything one step (or one drain of commands without a step) produced: one message."""

    deltas: list[TokenDelta]
    load: CoreLoad
    step: StepStats | None = None                                          # None: no step ran
    rejected: list[tuple[str, ConveyorError]] = field(default_factory=list)  # adds the core refused
    num_added: int = 0                                                       # adds received, refused or not
    snapshot: BatchSnapshot | None = None                                    # only while watched (WatchBatch)


# ------------------------------------------------------------------ front output


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: deltas, and on the last one the totals."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None      # set when finished, when the core's figures are at hand
    prompt_token_ids: list[int] | None = None  # set when finished
    prompt_logprobs: list[PromptLogprob | None] | None = None   # with the first output, when asked for
    # Several steps' outputs merged while their consumer was busy (front/output_stream.py): each step's
    # (characters of new_text, tokens), in order; None for one step's output.
    steps: list[tuple[int, int]] | None = None
