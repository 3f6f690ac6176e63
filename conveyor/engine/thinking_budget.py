"""Reasoning budgets: after a request's budget of thinking tokens, its end tag is forced, token by token.

As llama.cpp's reasoning-budget sampler: a request waits for the output to open the thinking with the
start tag's tokens (or starts inside it, when its prompt opened it), counts the thinking tokens, sees a
natural end when the output's last tokens are the end tag's, and past the budget forces the rest of
the end tag: each such step's mask allows only the tag's next token. The tags are matched as token
ids (the tag tokenized alone), which reasoning models write as one special token each.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from conveyor.sampling_params import ThinkingBudget


class _State(enum.Enum):
    WAITING = "waiting"      # for the output to open the thinking
    COUNTING = "counting"
    FORCING = "forcing"
    DONE = "done"


@dataclass(slots=True)
class _Track:
    spec: ThinkingBudget
    state: _State
    num_thinking: int = 0
    num_output: int = 0
    num_forced: int = 0              # end tag tokens already in the output while forcing
    tail: list[int] = field(default_factory=list)   # the last len(end tag) output tokens


def _prefix_overlap(tail: list[int], tag: tuple[int, ...]) -> int:
    """Length of the longest suffix of tail that is a proper prefix of tag."""
    for k in range(min(len(tail), len(tag) - 1), 0, -1):
        if tuple(tail[-k:]) == tag[:k]:
            return k
    return 0


class ThinkingBudgets:
    """The budgeted requests of one engine core."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._tracks: dict[str, _Track] = {}

    def add(self, request_id: str, spec: ThinkingBudget) -> None:
        track = _Track(spec, _State.COUNTING if spec.starts_inside else _State.WAITING)
        self._tracks[request_id] = track
        self._check_budget(track)

    def drop(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tracks

    def forced_masks(self, request_ids: list[str]) -> dict[str, torch.Tensor]:
        """(1, words) int32 packed masks for the rows whose next token is forced: the end tag's next token."""
        masks = {}
        for request_id in request_ids:
            track = self._tracks.get(request_id)
            if track is not None and track.state is _State.FORCING:
                masks[request_id] = self._only(track.spec.end_token_ids[track.num_forced])
        return masks

    def _only(self, token_id: int) -> torch.Tensor:
        mask = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        bit = 1 << (token_id % 32)
        mask[0, token_id // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit
        return mask

    def accept(self, request_id: str, token_ids: list[int]) -> None:
        track = self._tracks.get(request_id)
        if track is None:
            return
        for token_id in token_ids:
            self._step(track, token_id)
        if track.state is _State.DONE:
            del self._tracks[request_id]

    def _step(self, track: _Track, token_id: int) -> None:
        spec, position = track.spec, track.num_output
        track.num_output += 1
        end = spec.end_token_ids
        track.tail = (track.tail + [token_id])[-len(end):]
        if track.state is _State.WAITING:
            start = spec.start_token_ids
            if position >= len(start) or start[position] != token_id:
                track.state = _State.DONE   # the output did not open with the thinking: nothing to budget
            elif position == len(start) - 1:
                track.state = _State.COUNTING
                self._check_budget(track)
        elif track.state is _State.COUNTING:
            track.num_thinking += 1
            if tuple(track.tail) == end:
                track.state = _State.DONE
            else:
                self._check_budget(track)
        elif track.state is _State.FORCING:
            track.num_forced += 1
            if track.num_forced == len(end):
                track.state = _State.DONE

    def _check_budget(self, track: _Track) -> None:
        if track.state is _State.COUNTING and track.num_thinking >= track.spec.max_tokens:
            # The model may have begun the end tag itself: force only the rest of it.
            track.state, track.num_forced = _State.FORCING, _prefix_overlap(track.tail, track.spec.end_token_ids)
