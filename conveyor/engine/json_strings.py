"""Open-ended JSON strings, bounded by the sampler rather than by the grammar.

A schema's string without maxLength is an unbounded repetition in its grammar: a model that keeps writing
inside a string runs until max_tokens and leaves invalid JSON. A maxLength in the grammar bounds it, but
costs 1-2 s of compiling per string property with xgrammar 0.2.8. Instead the core follows each JSON output
with a small lexer (inside a string or not, an escape pending) and, once a string has run for
`max_string_tokens` tokens, narrows that step's grammar mask to the tokens that begin with a closing quote,
when the grammar allows one there (a minLength or pattern not yet met keeps the string open, and the next
step tries again). It costs one AND of a mask row on such a step and nothing at compile time. A schema's own
maxLength raises the bound, so a string the schema allows is never cut (6 tokens per character cover a
\\uXXXX escape written one character per token).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from conveyor.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:   # the server's process (the front) imports this module and never loads torch
    import torch

_QUOTE, _BACKSLASH = 0x22, 0x5C
_TOKENS_PER_CHAR = 6


@dataclass(slots=True)
class _Lexer:
    bound: int
    in_string: bool = False
    escaped: bool = False
    run: int = 0   # tokens that wrote part of the open string, its opening quote's included

    def feed(self, data: bytes) -> None:
        for byte in data:
            if not self.in_string:
                if byte == _QUOTE:
                    self.in_string, self.run = True, 0
            elif self.escaped:
                self.escaped = False
            elif byte == _BACKSLASH:
                self.escaped = True
            elif byte == _QUOTE:
                self.in_string = False
        if self.in_string:
            self.run += 1

    @property
    def must_close(self) -> bool:
        return self.in_string and not self.escaped and self.run >= self.bound


def string_bound(spec: StructuredOutputsParams) -> int | None:
    """The token bound of this constraint's strings, or None: not JSON, bounding off, or thinking first
    (its text is not JSON and the lexer would read its quotes)."""
    if not spec.max_string_tokens or spec.after_thinking is not None or not (spec.json_object or spec.json is not None):
        return None
    schema: Any = spec.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            return spec.max_string_tokens
    longest, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("maxLength"), int) and not isinstance(node["maxLength"], bool):
                longest = max(longest, node["maxLength"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return max(spec.max_string_tokens, _TOKENS_PER_CHAR * longest + 1)


class StringBounds:
    """The bounded JSON outputs of one core: a lexer per request, and the mask of closing-quote tokens."""

    def __init__(self, vocab_size: int, token_bytes: Callable[[], list[bytes]]) -> None:
        self.vocab_size = vocab_size
        self._token_bytes = token_bytes      # the tokenizer's bytes per token id, fetched on first use
        self._vocab: list[bytes] | None = None
        self._close: torch.Tensor | None = None
        self._lexers: dict[str, _Lexer] = {}

    def add(self, request_id: str, bound: int) -> None:
        self._lexers[request_id] = _Lexer(bound)

    def drop(self, request_id: str) -> None:
        self._lexers.pop(request_id, None)

    def accept(self, request_id: str, token_ids: list[int]) -> None:
        lexer = self._lexers.get(request_id)
        if lexer is None:
            return
        vocab = self._bytes()
        for token_id in token_ids:
            lexer.feed(vocab[token_id] if token_id < len(vocab) else b"")

    def narrow(self, request_id: str, mask: torch.Tensor) -> None:
        """Past the bound, keep only the closing-quote tokens of `mask`'s first row (in place), where the
        grammar allows any."""
        lexer = self._lexers.get(request_id)
        if lexer is None or not lexer.must_close:
            return
        narrowed = mask[0:1] & self._close_mask()
        if bool(narrowed.any()):
            mask[0:1] = narrowed

    def _bytes(self) -> list[bytes]:
        if self._vocab is None:
            self._vocab = self._token_bytes()
        return self._vocab

    def _close_mask(self) -> torch.Tensor:
        """(1, words) int32, packed as the grammar's masks: the tokens whose text begins with a quote."""
        if self._close is None:
            words = (self.vocab_size + 31) // 32
            bits = np.zeros(words * 32, dtype=np.uint8)
            bits[[i for i, data in enumerate(self._bytes()[:self.vocab_size]) if data[:1] == b'"']] = 1
            packed = np.packbits(bits, bitorder="little").view("<u4").view(np.int32)
            import torch   # the engine core's process only: the mask is applied there

            self._close = torch.from_numpy(packed.copy()).reshape(1, words)
        return self._close
