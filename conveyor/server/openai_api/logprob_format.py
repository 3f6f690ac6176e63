"""Token logprobs as each API writes them: completions' parallel lists, chat's entries, vLLM's prompt_logprobs.

Token strings are looked up through LRU caches (the same tokens come back all the time). With
`return_tokens_as_token_ids` (vLLM's field) a token is written "token_id:N" instead of its text, so a
client can tell apart tokens whose text is the same or not whole UTF-8 characters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from conveyor.text.tokenizer import Tokenizer
from conveyor.logprobs import PromptLogprob, TokenLogprobs
from conveyor.server.openai_api.responses import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptTokenLogprob, TopLogprob

PromptLogprobsOut = list[dict[str, PromptTokenLogprob] | None]


class LogprobFormatter:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.token_text: Callable[[int], str] = functools.lru_cache(maxsize=1 << 16)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))
        self.token_bytes: Callable[[int], bytes] = functools.lru_cache(maxsize=1 << 16)(tokenizer.token_bytes)

    def completion_token(self, token_id: int, as_ids: bool = False) -> str:
        """The token as completions' logprobs name it: its text, or, for a token that is not whole UTF-8
        characters, "bytes:" and its bytes escaped, as OpenAI writes them (so such tokens stay apart)."""
        if as_ids:
            return f"token_id:{token_id}"
        text = self.token_text(token_id)
        if "\ufffd" in text:
            raw = self.token_bytes(token_id)
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text

    def completion_logprobs(self, logprobs: list[TokenLogprobs], text_offset: int, as_ids: bool = False,
                            prompt: list[PromptLogprob | None] | None = None,
                            prompt_token_ids: list[int] | None = None, num_top: int = 0) -> CompletionLogprobs:
        """Completions' logprobs; with `prompt` (echo), the prompt's tokens come first (with their top
        `num_top`), the first with null logprobs as OpenAI writes it, and `text_offset` counts from the
        prompt's start."""
        result = CompletionLogprobs()
        for token_id, entry in zip(prompt_token_ids or [], prompt or []):
            token = self.completion_token(token_id, as_ids)
            result.tokens.append(token)
            result.text_offset.append(text_offset)
            text_offset += len(self.token_text(token_id))
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            top = {self.completion_token(i, as_ids): lp for i, lp in entry.top[:num_top]}
            top.setdefault(token, entry.logprob)
            result.token_logprobs.append(entry.logprob)
            result.top_logprobs.append(top)
        for entry in logprobs:
            token = self.completion_token(entry.token_id, as_ids)
            top = {self.completion_token(token_id, as_ids): logprob for token_id, logprob in entry.top}
            top.setdefault(token, entry.logprob)
            result.tokens.append(token)
            result.token_logprobs.append(entry.logprob)
            result.top_logprobs.append(top)
            result.text_offset.append(text_offset)
            text_offset += len(self.token_text(entry.token_id))
        return result

    def chat_logprobs(self, logprobs: list[TokenLogprobs], as_ids: bool = False) -> ChatLogprobs:
        def top(token_id: int, logprob: float) -> TopLogprob:
            # bytes are the token's own, also where its text is U+FFFD (a part of a UTF-8 character)
            token = f"token_id:{token_id}" if as_ids else self.token_text(token_id)
            return TopLogprob(token=token, logprob=logprob, bytes=list(self.token_bytes(token_id)))

        content = []
        for entry in logprobs:
            sampled = top(entry.token_id, entry.logprob)
            content.append(ChatTokenLogprob(token=sampled.token, logprob=sampled.logprob, bytes=sampled.bytes,
                                            top_logprobs=[top(i, lp) for i, lp in entry.top]))
        return ChatLogprobs(content=content)

    def prompt_logprobs(self, prompt_token_ids: list[int], entries: list[PromptLogprob | None],
                        as_ids: bool = False, num_top: int = 0) -> PromptLogprobsOut:
        """vLLM's prompt_logprobs: per prompt token, null for the first, else {token id: {logprob, rank,
        decoded_token}} for the prompt's own token and the top N."""
        out: PromptLogprobsOut = []
        for token_id, entry in zip(prompt_token_ids, entries):
            if entry is None:
                out.append(None)
                continue
            ranked = {i: (lp, rank) for rank, (i, lp) in enumerate(entry.top[:num_top], start=1)}
            ranked.setdefault(token_id, (entry.logprob, entry.rank))
            out.append({str(i): PromptTokenLogprob(logprob=lp, rank=rank,
                                                   decoded_token=f"token_id:{i}" if as_ids else self.token_text(i))
                        for i, (lp, rank) in ranked.items()})
        return out
