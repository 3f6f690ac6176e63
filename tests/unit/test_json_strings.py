"""The JSON string bound without a model: the lexer's strings and escapes, the bound a spec gets (none
for non-JSON or thinking-first constraints, raised by a schema's maxLength), and the narrowed mask (only
closing-quote tokens, only where the grammar allows one, never after a pending backslash)."""

from __future__ import annotations

import torch

from conveyor.engine.json_strings import StringBounds, string_bound
from conveyor.sampling_params import DEFAULT_MAX_STRING_TOKENS, StructuredOutputsParams

VOCAB = [b"{", b'"', b"a", b'",', b"\\", b'"}', b"}", b"b"]   # ids 0..7
QUOTE_LED = {1, 3, 5}


def _mask(token_ids: set[int]) -> torch.Tensor:
    word = sum(1 << i for i in token_ids)
    return torch.tensor([[word]], dtype=torch.int32)


def _allowed(mask: torch.Tensor) -> set[int]:
    word = int(mask[0, 0]) & 0xFFFFFFFF
    return {i for i in range(32) if word >> i & 1}


def test_bounds_per_spec() -> None:
    assert string_bound(StructuredOutputsParams(json_object=True)) == DEFAULT_MAX_STRING_TOKENS
    assert string_bound(StructuredOutputsParams(json={"type": "string"}, max_string_tokens=5)) == 5
    assert string_bound(StructuredOutputsParams(json='{"properties": {"s": {"maxLength": 10}}}',
                                                max_string_tokens=5)) == 61
    assert string_bound(StructuredOutputsParams(json_object=True, max_string_tokens=0)) is None
    assert string_bound(StructuredOutputsParams(regex="a+")) is None
    assert string_bound(StructuredOutputsParams(json_object=True, after_thinking="open")) is None


def test_narrowing_after_the_bound() -> None:
    bounds = StringBounds(len(VOCAB), lambda: VOCAB)
    bounds.add("r", 3)
    everything = set(range(len(VOCAB)))
    bounds.accept("r", [0, 1])          # {"   : a string opened, 1 token
    mask = _mask(everything)
    bounds.narrow("r", mask)
    assert _allowed(mask) == everything
    bounds.accept("r", [2, 4])          # a\  : 3 tokens, an escape pending: not now
    bounds.narrow("r", mask)
    assert _allowed(mask) == everything
    bounds.accept("r", [1])             # \"  : an escaped quote, the string goes on (4 tokens)
    bounds.narrow("r", mask)
    assert _allowed(mask) == QUOTE_LED
    only_letters = _mask({2, 7})        # the grammar allows no quote here: left as it is
    bounds.narrow("r", only_letters)
    assert _allowed(only_letters) == {2, 7}
    bounds.accept("r", [3])             # ",  : closed; the next string starts its own count
    mask = _mask(everything)
    bounds.narrow("r", mask)
    assert _allowed(mask) == everything
    bounds.drop("r")
    bounds.narrow("r", mask)
    assert _allowed(mask) == everything
