"""Text <-> token ids for the engine.

Owns the `Tokenizer` (a `tokenizers.Tokenizer` plus its special tokens and BOS policy) and the
`IncrementalDetokenizer` that turns a stream of sampled ids into text deltas. Chat templates are
rendered by chat_template.py; tokenizer_loader.py builds a `Tokenizer` from a checkpoint's files.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

import jinja2
from tokenizers import Tokenizer as BackendTokenizer

from conveyor.text.chat_template import compile_chat_template, render_chat_template, takes_tools
from conveyor.errors import InvalidRequest

logger = logging.getLogger(__name__)

RELEASE_GIL_CHARS = 16 * 1024   # longer texts are tokenized with the GIL released


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: each of the 256 characters a byte-level BPE vocabulary
    spells a byte with -> that byte. Printable Latin-1 bytes stand for themselves; the others are
    shifted to 256 and up."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    byte_of = {chr(b): b for b in kept}
    shifted = 0
    for byte in range(256):
        if chr(byte) not in byte_of:
            byte_of[chr(256 + shifted)] = byte
            shifted += 1
    return byte_of


# ---------------------------------------------------------------------------------------------


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens, BOS policy and chat template of one checkpoint.

    Special tokens in text (like `<|im_start|>`) are matched whole, as Hugging Face does. BOS is
    prepended by `encode` only, and only when `add_bos` is set; the backend adds nothing itself.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Iterable[int] = (),
        add_bos: bool = False,
        chat_template: str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.backend: BackendTokenizer = backend
        if vocab_size is None:
            vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.vocab_size: int = vocab_size
        self.bos_token: str | None = bos_token
        self.eos_token: str | None = eos_token
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token is not None else None
        eos_ids = set(eos_token_ids)
        if eos_token is not None:
            eos_id = backend.token_to_id(eos_token)
            if eos_id is None:
                logger.warning("eos token %r is not in the vocabulary", eos_token)
            else:
                eos_ids.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        if add_bos and self.bos_token_id is None:
            raise ValueError(f"add_bos is set but the bos token {bos_token!r} is not in the vocabulary")
        self.add_bos: bool = add_bos
        self.chat_template: str | None = chat_template
        self._compiled_template: jinja2.Template | None = None
        self._takes_tools: tuple[str, bool] | None = None   # (template, whether it reads `tools`)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_ids={sorted(self.eos_token_ids)}, add_bos={self.add_bos})"
        )

    # -- encode / decode -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > RELEASE_GIL_CHARS:
            # `encode` holds the GIL throughout (8 MB: 10 s in which no other thread runs, the
            # server's event loop included); `encode_batch` releases it and gives the same ids.
            ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos:
            assert self.bos_token_id is not None  # checked in __init__
            return [self.bos_token_id, *ids]
        return ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest token as the vocabulary spells it: no token decodes to more.

        (A byte-level token spells each of its bytes as one character; a text has no more
        characters than bytes.)
        """
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = False
               ) -> str:
        """`spaces_between_special_tokens`: added tokens shown set apart by single spaces, as transformers'
        slow tokenizers (and vLLM's field of that name) write them; off, the tokens' text is joined as is."""
        if not spaces_between_special_tokens:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        added = self.backend.get_added_tokens_decoder()
        parts: list[str] = []
        run: list[int] = []
        for token_id in [*ids, -1]:   # -1 flushes the last run
            token = added.get(token_id)
            if token is None and token_id >= 0:
                run.append(token_id)
                continue
            if run:
                parts.append(self.backend.decode(run, skip_special_tokens=skip_special_tokens))
                run = []
            if token is not None and not (skip_special_tokens and token.special):
                parts.append(token.content)
        return " ".join(part for part in parts if part)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, also when they are part of a UTF-8 character (where decode
        gives U+FFFD): a byte-level BPE token's bytes, a `<0xNN>` byte-fallback token's byte, an added
        token's text."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_token_ids:
            return piece.encode("utf-8")
        if self._is_byte_level:
            byte_of = _byte_level_decoder()
            if all(c in byte_of for c in piece):
                return bytes(byte_of[c] for c in piece)
            return piece.encode("utf-8")
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")   # SentencePiece spells a space as U+2581

    @functools.cached_property
    def _added_token_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    @functools.cached_property
    def _is_byte_level(self) -> bool:
        decoder = self.backend.decoder
        return decoder is not None and '"ByteLevel"' in decoder.__getstate__().decode("utf-8")

    # -- chat template -------------------------------------------------------------------------

    @property
    def template_takes_tools(self) -> bool:
        """Whether the template reads `tools`: parsed once per template (Qwen2.5's takes ~8 ms, on the
        event loop of every chat request)."""
        source = self.chat_template
        if source is None:
            return False
        if self._takes_tools is None or self._takes_tools[0] != source:
            self._takes_tools = (source, takes_tools(source))
        return self._takes_tools[1]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        """Render `messages` with the checkpoint's template, as transformers' apply_chat_template(tokenize=False).

        Raises `InvalidRequest` (a `ValueError`) when there is no template or the template rejects
        the messages, and `ValueError` when the template itself does not parse.
        """
        if self.chat_template is None:
            raise InvalidRequest("this model has no chat template; send a plain prompt instead of messages")
        if self._compiled_template is None:
            self._compiled_template = compile_chat_template(self.chat_template)
        return render_chat_template(self._compiled_template, messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token, tools=tools,
                                    template_kwargs=template_kwargs)

    def use_chat_template(self, text: str) -> None:
        """Replace the checkpoint's template; ValueError (naming the problem) if it does not parse."""
        try:
            self._compiled_template = compile_chat_template(text)
        except Exception as exc:
            raise ValueError(f"the chat template does not parse: {exc}") from exc
        self.chat_template = text


class IncrementalDetokenizer:
    """Turns sampled token ids into text deltas, one token at a time.

    Uses vLLM/TGI's two offsets: `prefix_offset..read_offset` are tokens already shown, decoded again
    as context, and text is emitted only for what decoding `prefix_offset..` adds beyond that. A delta
    that ends in U+FFFD is an incomplete UTF-8 sequence, so it is held back until later tokens finish it.
    Invariant: `text` is a prefix of decode(all output ids), equal to it whenever nothing is held back.
    """

    # Prompt tokens decoded with the first outputs so decoders that look at context (leading spaces) agree.
    _PROMPT_CONTEXT_TOKENS = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int] | None = None,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces = spaces_between_special_tokens
        self._token_ids: list[int] = list(prompt_token_ids or [])[-self._PROMPT_CONTEXT_TOKENS :]
        self._read_offset = len(self._token_ids)
        self._prefix_offset = 0
        self._text = ""

    @property
    def text(self) -> str:
        """All output text emitted so far (the prompt is not included)."""
        return self._text

    def push(self, token_id: int) -> str:
        """Add one output token and return the newly completed text (possibly empty)."""
        self._token_ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._token_ids[self._prefix_offset : self._read_offset], self._skip_special_tokens,
                             self._spaces)
        new_text = decode(self._token_ids[self._prefix_offset :], self._skip_special_tokens, self._spaces)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._text += delta
        return delta
