"""Builders shared by the model-free tests: make_request, FakeClock, a strict block audit; for the front's
tests a tiny trained BPE tokenizer and a core client that records what the front sends."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from conveyor.core.block_manager import BlockManager
from conveyor.core.request import Request
from conveyor.sampling_params import SamplingParams

if TYPE_CHECKING:   # the core's tests import no text or message code
    from conveyor.engine.messages import CoreCommand, CoreInfo
    from conveyor.text.tokenizer import Tokenizer

EOS = 2


class FakeClock:
    """A clock that moves only when told to, so timestamps in tests are exact."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float = 1.0) -> None:
        self.now_s += seconds


def make_request(request_id: str, prompt_len: int = 4, *, prompt: Sequence[int] | None = None,
                 max_tokens: int = 4, min_tokens: int = 0, ignore_eos: bool = False,
                 stop_token_ids: Iterable[int] = (), priority: int = 0,
                 eos_token_ids: Iterable[int] = (EOS,), arrival_s: float = 0.0, tenant: str = "") -> Request:
    """A request whose prompt is `prompt`, or `prompt_len` tokens 100, 101, ... (never the eos id)."""
    prompt_token_ids = list(prompt) if prompt is not None else [100 + i for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                            stop_token_ids=list(stop_token_ids))
    return Request(request_id=request_id, prompt_token_ids=prompt_token_ids, params=params,
                   arrival_s=arrival_s, max_tokens=max_tokens, eos_token_ids=frozenset(eos_token_ids),
                   priority=priority, tenant=tenant)


def audit_blocks(blocks: BlockManager, live: Iterable[Request]) -> None:
    """check_integrity plus what it skips: holders == ref counts even with no live request, and a
    block held by several requests is a published prefix-cache block."""
    live = list(live)
    blocks.check_integrity(live)
    holders = [0] * blocks.num_blocks
    for request in live:
        assert len(set(request.block_table)) == len(request.block_table), \
            f"{request.request_id} holds a block twice: {request.block_table}"
        for block_id in request.block_table:
            holders[block_id] += 1
    assert holders == blocks.ref_counts, f"holders {holders} != ref counts {blocks.ref_counts}"
    for block_id, count in enumerate(holders):
        if count > 1:
            assert blocks.block_hashes[block_id] is not None, f"unhashed block {block_id} is shared"
    assert blocks.num_free_blocks + blocks.num_used_blocks == blocks.num_blocks
    assert blocks.num_used_blocks == sum(1 for c in holders if c > 0)
    assert len(blocks.cached) == sum(1 for h in blocks.block_hashes if h is not None)


def tiny_bpe_tokenizer(text: str = "the quick brown fox jumps over the lazy dog", vocab_size: int = 300) -> Tokenizer:
    """A byte-level BPE of `vocab_size` tokens trained on one text, with <|endoftext|> as a special token."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from conveyor.text.tokenizer import Tokenizer

    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([text] * 10, trainer=trainer)
    return Tokenizer(backend)


class RecordingClient:
    """A core client that only records what the front sends; a test plays the core's messages."""

    def __init__(self, info: CoreInfo) -> None:
        self.info = info
        self.sent: list[CoreCommand] = []

    def send(self, command: CoreCommand) -> None:
        self.sent.append(command)
