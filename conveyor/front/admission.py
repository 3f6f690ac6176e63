"""The one admission point: whether a request fits is decided here, in the front, before the core.

Checks need only the model's limits (`CoreInfo`), so the front refuses a bad request with its own
status (400) without a round trip to the core. Here too `max_tokens` is resolved ("None: up to the
model length"), once; the core and its scheduler trust the CoreRequest they get.
"""

from __future__ import annotations

from collections.abc import Callable

from conveyor.engine.messages import CoreInfo
from conveyor.errors import ContextLengthExceeded, InvalidRequest
from conveyor.sampling_params import SamplingParams


def check_token_ids(prompt: object, vocab_size: int) -> list[int]:
    """A prompt given as token ids: a list of ints inside the vocabulary. Returns a copy."""
    # Builtins over the whole list (C loops): this runs on the event loop, for prompts of 100k+ tokens.
    if not isinstance(prompt, list) or not set(map(type, prompt)) <= {int}:   # bool is not int here
        raise InvalidRequest("a prompt must be a string or a list of token ids", param="prompt")
    if prompt and not (min(prompt) >= 0 and max(prompt) < vocab_size):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", param="prompt")
    return list(prompt)


def truncate_prompt(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last N tokens (-1: the model length); the prompt
    itself when not set."""
    keep = params.truncate_prompt_tokens
    if keep is None:
        return prompt_token_ids
    if keep > max_model_len:
        raise InvalidRequest(f"truncate_prompt_tokens ({keep}) is over this model's maximum context length "
                             f"({max_model_len})", param="truncate_prompt_tokens")
    return prompt_token_ids[-(max_model_len if keep == -1 else keep):]


def bad_words_token_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Each bad word's tokens as written at a text's start and after a space (a different first token in
    byte-level vocabularies), as vLLM tokenizes them."""
    sequences: list[list[int]] = []
    for word in words:
        bare = encode(word.lstrip())
        spaced = encode(" " + word.lstrip())
        sequences += [ids for ids in (bare, spaced) if ids and ids not in sequences]
    return sequences


def check_request(prompt_token_ids: list[int], params: SamplingParams, info: CoreInfo) -> int:
    """Raise InvalidRequest / ContextLengthExceeded for a request that could never run; else return
    its resolved max_tokens."""
    check_token_ids(prompt_token_ids, info.vocab_size)
    bad_stops = [t for t in params.stop_token_ids if not 0 <= t < info.vocab_size]
    if bad_stops:
        raise InvalidRequest(f"stop token id {bad_stops[0]} is outside the vocabulary (0..{info.vocab_size - 1})",
                             param="stop_token_ids")
    bad_biased = [t for t in params.logit_bias or () if t >= info.vocab_size]
    if bad_biased:
        raise InvalidRequest(f"logit_bias token id {bad_biased[0]} is outside the vocabulary "
                             f"(0..{info.vocab_size - 1})", param="logit_bias")
    bad_allowed = [t for t in params.allowed_token_ids or () if t >= info.vocab_size]
    if bad_allowed:
        raise InvalidRequest(f"allowed_token_ids has token id {bad_allowed[0]}, outside the vocabulary "
                             f"(0..{info.vocab_size - 1})", param="allowed_token_ids")
    num_prompt_tokens = len(prompt_token_ids)
    if num_prompt_tokens == 0:
        raise InvalidRequest("the prompt is empty", param="prompt")
    # The prompt alone leaves no room for one output token: the prompt is at fault, not max_tokens.
    if num_prompt_tokens >= info.max_model_len:
        raise ContextLengthExceeded(
            f"the prompt has {num_prompt_tokens} tokens, and this model's maximum context "
            f"length is {info.max_model_len} tokens", param="prompt")
    if -(-(num_prompt_tokens + 1) // info.block_size) > info.num_kv_blocks:
        raise ContextLengthExceeded(
            f"the prompt has {num_prompt_tokens} tokens but the whole KV cache holds "
            f"{info.num_kv_blocks * info.block_size}", param="prompt")
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = info.max_model_len - num_prompt_tokens
    total = num_prompt_tokens + max_tokens
    if total > info.max_model_len:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {info.max_model_len} tokens; the request has "
            f"{num_prompt_tokens} prompt tokens plus max_tokens {max_tokens} = {total}", param="max_tokens")
    if -(-total // info.block_size) > info.num_kv_blocks:
        raise ContextLengthExceeded(
            f"the request needs {total} tokens of KV cache ({num_prompt_tokens} prompt + {max_tokens} "
            f"max_tokens) but the whole cache holds {info.num_kv_blocks * info.block_size}", param="max_tokens")
    return max_tokens
