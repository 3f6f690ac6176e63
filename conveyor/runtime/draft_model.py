"""DraftModelProposer: a smaller model of the same vocabulary guesses a request's next tokens.

Speculative decoding with a draft model: the draft decodes a few tokens, the target verifies
them all in one forward (a multi-token decode row, core/scheduler.py) and keeps those it would have
produced anyway, so outputs never depend on the draft; a good draft only makes them come sooner.

The draft keeps its own paged KV cache, with a block list per request. It reads each prompt chunk in
the step the model computes it (`follow`); a prompt found in the model's prefix cache is taken up from
where the model starts computing. Before it guesses it catches up with the request's context: what it
computed is kept up to where it still matches (a rejected guess only shortens it), the rest is computed
in one forward (a context it fell far behind on is taken up from its last 512 tokens), then it decodes
one token a forward, for every guessing request at once.
The scheduler asks it through the pure `Proposer` interface; the seconds it spends are reported
(`take_seconds`) so that the step's cost model learns the target's cost alone, and
`cost_per_token_s` is what one more guess costs here.

Greedy requests get the draft's argmax. A seeded request's guesses are drawn by the same sampler,
with the request's parameters and a copy of its generator as the model's step will find it: guess i
meets the very noise the model's position i draws, so where the two distributions are close the two
draws land on the same token (coupled sampling), and a seeded request keeps most guesses instead of
only those that fall on the draft's top token. The engine core gives an unseeded random request a
generator of its own when a draft runs (seeded from the shared one), so its guesses couple too.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conveyor.core.plan import ScheduledRow, StepPlan
from conveyor.core.request import Request
from conveyor.errors import ModelLoadError
from conveyor.model.gguf.metadata import read_gguf_metadata
from conveyor.runtime.model_runner import ModelRunner
from conveyor.runtime.sampler import Sampler, SamplingRow

logger = logging.getLogger(__name__)

_CATCH_UP_CHUNK = 512   # most context tokens the draft takes up in one propose
_COST_SMOOTHING = 0.2   # weight of the newest one-token forward in cost_per_token_s


# request id -> the request and its own generator (None: unseeded), as the model's next step will sample it
SamplingSource = Callable[[str], "tuple[Request, torch.Generator | None] | None"]


@dataclass(slots=True)
class _DraftState:
    # The draft holds the KV of the context from `offset` on (a prompt found in the model's prefix cache,
    # or a context it fell far behind on, is taken up from there: its positions count from 0).
    offset: int = 0
    token_ids: list[int] = field(default_factory=list)   # the context from offset whose KV the draft holds
    blocks: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Guessing:
    """One request's guessing in progress: what its next forward feeds, and its guesses so far."""

    request_id: str
    state: _DraftState
    choose: Callable[[torch.Tensor, list[int]], int]
    max_tokens: int
    pending: list[int]
    guesses: list[int]


class DraftModelProposer:
    """A draft model's guesses; `runner` steps the draft over its own KV cache."""

    def __init__(self, runner: ModelRunner, max_model_len: int, target_vocab_size: int) -> None:
        self.runner = runner
        self.block_size = runner.kv_cache.block_size
        self.max_model_len = max_model_len
        self.target_vocab_size = target_vocab_size
        self._free = list(range(runner.kv_cache.num_blocks - 1, -1, -1))
        self._states: dict[str, _DraftState] = {}
        self.cost_per_token_s = 0.0   # a one-token draft forward, smoothed; 0 until measured
        self._seconds = 0.0           # spent since the last take_seconds
        self.sampling_of: SamplingSource | None = None   # set by the engine core; None: every guess greedy
        self._sampler = Sampler(runner.device)

    def propose_many(self, asks: Sequence[tuple[str, Sequence[int], int]]) -> list[list[int]]:
        """Every request's guesses from the same forwards: one row per request, one forward per guess."""
        started = time.perf_counter()
        try:
            return self._propose_many(asks)
        finally:
            self._seconds += time.perf_counter() - started

    def forget(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self._free.extend(reversed(state.blocks))

    def follow(self, rows: Sequence[tuple[ScheduledRow, Sequence[int]]]) -> None:
        """Compute the prompt chunks the model just computed (prefill rows, each with its request's token
        ids) in one draft forward, so a request's first guesses find its prompt there and no later step
        stalls on a whole prompt. A prompt the model found in its prefix cache is taken up at most
        `_CATCH_UP_CHUNK` tokens before the model's first computed one. A row the draft cannot continue
        (it missed an earlier chunk, or is out of blocks) is left to `propose_many`'s catch-up."""
        started = time.perf_counter()
        batch = []
        for row, token_ids in rows:
            state = self._states.setdefault(row.request_id, _DraftState())
            if not state.token_ids or row.start_position < state.offset:
                state.offset = max(0, row.start_position - _CATCH_UP_CHUNK)
                del state.token_ids[:]
            start = row.start_position - state.offset
            if len(state.token_ids) < start and state.token_ids:
                continue
            tokens = [*token_ids[state.offset + len(state.token_ids):row.start_position], *row.token_ids]
            del state.token_ids[start:]   # a recompute after preemption starts over here
            start = len(state.token_ids)
            if not self._reserve(state, start + len(tokens)):
                self.forget(row.request_id)
                continue
            batch.append((state, ScheduledRow(request_id=row.request_id, token_ids=tokens, start_position=start,
                                              block_table=list(state.blocks), is_sampling=False, is_prefill=True)))
        if batch:
            self.runner.execute(StepPlan(rows=tuple(row for _, row in batch)))
            for state, row in batch:
                state.token_ids.extend(row.token_ids)
        self._seconds += time.perf_counter() - started

    def take_seconds(self) -> float:
        """Seconds spent guessing since the last call."""
        seconds, self._seconds = self._seconds, 0.0
        return seconds

    def _propose_many(self, asks: Sequence[tuple[str, Sequence[int], int]]) -> list[list[int]]:
        guesses: list[list[int]] = [[] for _ in asks]
        live: list[_Guessing] = []
        for i, (request_id, token_ids, max_tokens) in enumerate(asks):
            if max_tokens <= 0 or not token_ids or len(token_ids) + max_tokens - 1 > self.max_model_len:
                continue
            state = self._states.setdefault(request_id, _DraftState())
            context = token_ids[state.offset:]
            # The newest context token is always fed again: its logits give the first guess.
            keep = min(_common_prefix(state.token_ids, context), len(context) - 1)
            if len(context) - keep > _CATCH_UP_CHUNK:
                # Far behind (a context it never followed): take up only its last chunk, so no step
                # waits on the draft reading a whole prompt.
                state.offset, keep = len(token_ids) - _CATCH_UP_CHUNK, 0
                context = token_ids[state.offset:]
            del state.token_ids[keep:]
            if not self._reserve(state, len(context) + max_tokens - 1):
                self.forget(request_id)   # out of draft blocks: no guess, and nothing held
                continue
            pending = list(context[keep:])
            live.append(_Guessing(request_id, state, self._chooser(request_id), max_tokens, pending, guesses[i]))
        first = True
        while live:
            started = time.perf_counter()
            logits = self._forward([(g.request_id, g.state, g.pending) for g in live], sample=True)
            for g, row in zip(live, logits):
                token = g.choose(row[None], g.guesses)
                g.guesses.append(token)
                g.pending = [token]
            if not first:   # one guess more for every row: what a guess costs the step
                spent = time.perf_counter() - started
                self.cost_per_token_s = (spent if self.cost_per_token_s == 0.0 else
                                         (1 - _COST_SMOOTHING) * self.cost_per_token_s + _COST_SMOOTHING * spent)
            first = False
            live = [g for g in live if len(g.guesses) < g.max_tokens and g.guesses[-1] < self.target_vocab_size]
        # A token beyond the target's vocabulary (a padded draft row) can never be accepted.
        return [row[:next((i for i, token in enumerate(row) if token >= self.target_vocab_size), len(row))]
                for row in guesses]

    def _chooser(self, request_id: str) -> Callable[[torch.Tensor, list[int]], int]:
        """How this request's guesses are picked from the draft's logits (1, V), given the guesses so far."""
        source = self.sampling_of(request_id) if self.sampling_of is not None else None
        if source is None or source[1] is None or source[0].params.is_greedy:
            return lambda logits, guesses: int(torch.argmax(logits[0]))
        request, generator = source
        copy = torch.Generator(device=generator.device)
        copy.set_state(generator.get_state())   # the draws the model's step will make, in its order
        params = dataclasses.replace(request.params, logprobs=None)

        def draw(logits: torch.Tensor, guesses: list[int]) -> int:
            if logits.shape[1] < self.target_vocab_size:   # the same number of draws a position as the model's
                logits = torch.nn.functional.pad(logits, (0, self.target_vocab_size - logits.shape[1]),
                                                 value=float("-inf"))
            row = SamplingRow(params, request.prompt_token_ids, request.output_token_ids + guesses, copy,
                              request.eos_token_ids)
            return self._sampler.sample(logits[:, :self.target_vocab_size], [row]).token_ids[0]

        return draw

    def _reserve(self, state: _DraftState, num_tokens: int) -> bool:
        needed = -(-num_tokens // self.block_size) - len(state.blocks)
        if needed > len(self._free):
            return False
        for _ in range(max(needed, 0)):
            state.blocks.append(self._free.pop())
        return True

    def _forward(self, items: list[tuple[str, _DraftState, list[int]]], sample: bool) -> torch.Tensor:
        """Compute each request's tokens after its draft context, in one forward; with `sample`, the logits
        (rows, V) after each row's last token."""
        plan = StepPlan(rows=tuple(ScheduledRow(request_id=request_id, token_ids=tokens,
                                                start_position=len(state.token_ids), block_table=list(state.blocks),
                                                is_sampling=sample, is_prefill=len(tokens) > 1)
                                   for request_id, state, tokens in items))
        logits = self.runner.execute(plan)
        for _, state, tokens in items:
            state.token_ids.extend(tokens)
        return logits


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def check_same_vocabulary(model_path: Path, draft_path: Path) -> None:
    """Raise ModelLoadError unless the draft's tokens are the model's (ids and strings, on the ids both have)."""
    model_tokens, draft_tokens = _vocabulary(model_path), _vocabulary(draft_path)
    if model_tokens is None or draft_tokens is None:
        which = model_path if model_tokens is None else draft_path
        raise ModelLoadError(f"cannot read the vocabulary of {which}: a draft model must be checked to share the "
                             "model's tokens")
    common = min(len(model_tokens), len(draft_tokens))
    mismatch = next((i for i in range(common) if model_tokens[i] != draft_tokens[i]), None)
    if mismatch is not None or common == 0:
        raise ModelLoadError(f"the draft model {draft_path} does not share the model's vocabulary (token {mismatch} "
                             f"differs): speculative decoding needs the same tokenizer")


def _vocabulary(path: Path) -> list[str] | None:
    """Token strings by id: a GGUF file's tokenizer.ggml.tokens, or a folder's tokenizer.json."""
    try:
        if path.is_file():
            tokens = read_gguf_metadata(path, ("tokenizer.ggml.tokens",)).get("tokenizer.ggml.tokens")
            return [str(token) for token in tokens] if isinstance(tokens, list) else None
        data = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
        by_id = {int(i): str(token) for token, i in data["model"]["vocab"].items()}
        by_id.update({int(t["id"]): str(t["content"]) for t in data.get("added_tokens", [])})
        return [by_id.get(i, "") for i in range(max(by_id) + 1)] if by_id else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
